"""The one place attention meets the paged KV cache.

`write_kv` puts a step's new K/V into their slots; `paged_attention` reads K/V back through the block
tables. Both pick their path here and nowhere else (`backend`):
- "native": on the CPU, pagedchat's own kernel (csrc/layer_level.cpp, built with the quantized matmuls), which
  reads each sequence's pages where they lie. It runs a prompt's rows too, each as a decode at its position would
  run (see _row_plan): a row's numbers then depend on nothing but its own sequence
  (docs/architecture.md#same-request-same-tokens).
- "torch": the CPU without that kernel, and anywhere Triton is missing.
- "triton": CUDA.
PAGEDCHAT_ATTENTION=torch|triton|native forces one, for tests and comparison (native only where pagedchat's
kernels are loaded: PAGEDCHAT_KERNEL=off turns it off with them).

The pages hold the pool's page dtype, not necessarily the activations' (kernels/kv_pages.py): `write_kv` converts or
quantizes as it stores, the kernels read each dtype where it lies, and the torch path decodes what it gathers.

The torch path gathers each sequence's pages into a padded batch and runs SDPA; in decode steps it reads the
pages that every sequence shares (a common system prompt) once for the whole batch and merges the two partial
results, since on the CPU the cost of attention grows with the keys each sequence reads.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedchat.kernels import kv_pages
from pagedchat.model import qmm


@dataclass
class AttentionMetadata:
    """Where one step's tokens live: a flat batch of B sequences, T tokens, no padding."""

    slot_mapping: torch.Tensor     # [T] int64: page * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative query counts
    context_lens: torch.Tensor     # [B] int32: tokens in the cache per sequence, this step's included
    block_tables: torch.Tensor     # [B, max_pages] int32, padded with 0
    query_lens: list[int]          # host copies, for the torch path's loops
    context_lens_host: list[int]
    max_query_len: int
    max_context_len: int
    # Per-step values the torch decode path would otherwise rebuild in every layer (one per window size).
    _decode_plans: dict[int | None, _DecodePlan] = field(default_factory=dict, repr=False)
    _mixed_plan: _MixedPlan | None = field(default=None, repr=False)
    _row_plan: _RowPlan | None = field(default=None, repr=False)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


PATHS = ("torch", "triton", "native")
# The page dtypes the native kernel reads (kernels/kv_pages.py); others (float16) take the torch path.
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def backend(device: torch.device) -> str:
    """The attention path for a model on device: PAGEDCHAT_ATTENTION's, else the fastest one here. Call it once
    pagedchat's kernels are loaded (model/qmm.py), as building a model's weights does."""
    native = device.type == "cpu" and qmm.ready()  # the kernel is built with the quantized matmuls
    forced = os.environ.get("PAGEDCHAT_ATTENTION", "").lower()
    if forced in PATHS:
        return "torch" if forced == "native" and not native else forced
    if device.type == "cuda":
        from pagedchat.kernels import triton_available

        if triton_available():
            return "triton"
    return "native" if native else "torch"


def describe(path: str) -> str:
    """A path in words, for the bench's header."""
    return {"native": "pagedchat's kernel, read straight from the pages, each prompt row as a decode",
            "torch": "torch's SDPA over gathered pages",
            "triton": "pagedchat's Triton kernels"}[path]


def write_kv(k_cache, v_cache, k, v, meta: AttentionMetadata, path: str) -> None:
    if path == "triton":
        from pagedchat.kernels import write_kv as triton_write_kv

        triton_write_kv(k_cache, v_cache, kv_pages.encode(k, k_cache.dtype), kv_pages.encode(v, v_cache.dtype),
                        meta.slot_mapping)
        return
    # The cache is [pages, block_size, kv_heads, head_dim]: flattening the first two makes slots direct rows.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, kv_pages.encode(k, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, kv_pages.encode(v, v_cache.dtype))


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, path: str,
                    window: int | None = None) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim], causal over each sequence's cached context; with a
    window, a query at position p sees the keys at p - window + 1 .. p only (transformers' sliding window).
    path: one of PATHS (see backend)."""
    if path == "triton":
        from pagedchat.kernels import paged_attention as triton_attention

        return triton_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
                                scale, meta.max_query_len, meta.max_context_len, window or 0)
    native = path == "native" and k_cache.dtype in NATIVE_DTYPES
    if meta.decode_only:
        return _decode(q, k_cache, v_cache, meta, scale, window, native)
    if native:
        rows = _row_plan(meta)
        return qmm.attend(q, k_cache, v_cache, rows.tables, rows.context_lens, scale, window or 0)
    return _varlen_torch(q, k_cache, v_cache, meta, scale, window)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None,
            native: bool) -> torch.Tensor:
    if native:
        return qmm.attend(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window or 0)
    return _decode_torch(q, k_cache, v_cache, meta, scale, window)


def _gather(cache: torch.Tensor, flat_tables: torch.Tensor, b: int, length: int, dtype,
            out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Flattened [B * pages] tables -> [B, kv_heads, length, head_dim] keys or values, in logical order.

    `out` is (raw, upcast) buffers to gather into, reused across layers so each step allocates them once."""
    # index_select on the flattened table is several times faster than advanced indexing on the CPU.
    if out is None:
        pages = kv_pages.decode(cache.index_select(0, flat_tables), dtype)
    else:
        raw, upcast = out
        pages = torch.index_select(cache, 0, flat_tables, out=raw)
        if upcast is not raw:
            pages = upcast.copy_(kv_pages.decode(raw, dtype) if raw.dtype == torch.int8 else raw)
    _, bs, h, d = pages.shape
    return pages.view(b, -1, h, d)[:, :length].transpose(1, 2)


def _math_dtype(q: torch.Tensor) -> torch.dtype:
    """fp16 attention on the CPU has no fast kernel, so it is upcast. bf16 stays bf16 (the flash kernel
    accumulates in fp32, as transformers' bf16 sdpa does), which skips copying every gathered page to fp32
    (measured in docs/bench.md#decode-attention-in-bf16-shared-prefix-read-once)."""
    return torch.float32 if q.device.type == "cpu" and q.dtype == torch.float16 else q.dtype


# The CPU flash kernel behind F.scaled_dot_product_attention, which also returns each row's log-sum-exp:
# what merging two partial attentions needs. Missing (another torch, another device): no shared-prefix split.
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Reading a shared prefix once instead of once per sequence costs an extra attention call, gathers and a
# merge per layer, about what reading this many keys costs: below it the split is a loss (per-layer timings
# in docs/bench.md#decode-attention-in-bf16-shared-prefix-read-once).
SHARED_PREFIX_MIN_SAVED_KEYS = 1536


@dataclass
class _DecodePlan:
    """What every layer's decode attention reuses within one step; the first layer builds it."""

    tables: torch.Tensor         # flat page ids each sequence reads on its own, [B * pages]
    length: int                  # keys per sequence in those pages (the longest; shorter ones are masked)
    mask: torch.Tensor           # [B, 1, 1, length] additive: 0 on a sequence's keys, -inf past its end
    k: tuple[torch.Tensor, torch.Tensor]  # gather buffers (see _gather)
    v: tuple[torch.Tensor, torch.Tensor]
    prefix_tables: torch.Tensor | None = None  # pages every sequence shares, read once for the whole batch
    prefix_len: int = 0
    prefix_k: tuple[torch.Tensor, torch.Tensor] | None = None
    prefix_v: tuple[torch.Tensor, torch.Tensor] | None = None


def _shared_pages(meta: AttentionMetadata, block_size: int) -> int:
    """Leading pages that every sequence's table holds (the chats' common system prompt, a fork's history),
    if reading them once saves enough; each sequence keeps at least one key of its own past them."""
    b = meta.block_tables.shape[0]
    if _flash_with_lse is None or meta.block_tables.device.type != "cpu" or b < 2:
        return 0
    cap = (min(meta.context_lens_host) - 1) // block_size
    tables = meta.block_tables[:, :cap]
    same = int((tables == tables[:1]).all(0).int().cumprod(0).sum()) if cap > 0 else 0
    return same if (b - 1) * same * block_size >= SHARED_PREFIX_MIN_SAVED_KEYS else 0


def _buffers(pages: int, cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (pages, *cache.shape[1:])
    raw = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    if dtype == cache.dtype:
        return raw, raw
    head_dim = shape[-1] - kv_pages.SCALE_BYTES if cache.dtype == torch.int8 else shape[-1]
    return raw, torch.empty((*shape[:-1], head_dim), dtype=dtype, device=cache.device)


def _decode_plan(meta: AttentionMetadata, cache: torch.Tensor, dtype: torch.dtype, window: int | None) -> _DecodePlan:
    if window not in meta._decode_plans:
        block_size = cache.shape[1]
        # A window reads from the first page any sequence's window reaches, and no pages are read once for all.
        shared = 0 if window else _shared_pages(meta, block_size)
        first = max(0, min(meta.context_lens_host) - window) // block_size if window else shared
        start = first * block_size
        length = meta.max_context_len - start
        tables = meta.block_tables[:, first : first + -(-length // block_size)]
        positions = torch.arange(start, meta.max_context_len, device=cache.device)
        ctx = meta.context_lens[:, None].to(positions.dtype)
        hidden = positions[None, :] >= ctx
        if window:
            hidden |= positions[None, :] < ctx - window
        mask = torch.zeros(hidden.shape, dtype=dtype, device=cache.device).masked_fill_(hidden, float("-inf"))
        plan = _DecodePlan(tables.reshape(-1), length, mask[:, None, None, :],
                           _buffers(tables.numel(), cache, dtype), _buffers(tables.numel(), cache, dtype))
        if shared:
            plan.prefix_tables = meta.block_tables[0, :shared]
            plan.prefix_len = start
            plan.prefix_k, plan.prefix_v = _buffers(shared, cache, dtype), _buffers(shared, cache, dtype)
        meta._decode_plans[window] = plan
    return meta._decode_plans[window]


def _decode_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """All sequences at once: one query each, keys padded to the longest context and masked.

    Grouped-query heads that share a KV head become that head's query rows ([B, kv_heads, group, D]), so
    no K/V is repeated and one attention call serves the group. Pages that every sequence shares are
    attended once for all of them (see _with_shared_prefix)."""
    dtype, (b, heads, d) = _math_dtype(q), q.shape
    plan = _decode_plan(meta, k_cache, dtype, window)
    k = _gather(k_cache, plan.tables, b, plan.length, dtype, plan.k)
    v = _gather(v_cache, plan.tables, b, plan.length, dtype, plan.v)
    kv_heads = k.shape[1]
    queries = q.reshape(b, kv_heads, heads // kv_heads, d).to(dtype)
    if plan.prefix_tables is None:
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=plan.mask, scale=scale)
    else:
        out = _with_shared_prefix(queries, k, v, k_cache, v_cache, plan, scale)
    return out.reshape(b, heads, d).to(q.dtype)


def _with_shared_prefix(queries, k, v, k_cache, v_cache, plan: _DecodePlan, scale: float) -> torch.Tensor:
    """Attention over [shared prefix | own keys] as two partial attentions merged by their log-sum-exps.

    The prefix's K/V are gathered once and every sequence's query rows attend to them in one call, instead of
    each sequence gathering and reading its own copy: B chats on one system prompt read its keys once, not B
    times (cascade attention, as in FlashInfer and vLLM)."""
    b, kv_heads, group, d = queries.shape
    dtype = queries.dtype
    own, own_lse = _flash_with_lse(queries, k, v, attn_mask=plan.mask, scale=scale)
    pk = _gather(k_cache, plan.prefix_tables, 1, plan.prefix_len, dtype, plan.prefix_k)
    pv = _gather(v_cache, plan.prefix_tables, 1, plan.prefix_len, dtype, plan.prefix_v)
    rows = queries.transpose(0, 1).reshape(1, kv_heads, b * group, d)
    shared, shared_lse = _flash_with_lse(rows, pk, pv, scale=scale)
    shared = shared.view(kv_heads, b, group, d).transpose(0, 1)
    shared_lse = shared_lse.view(kv_heads, b, group).transpose(0, 1)
    # The full softmax weighs each part by its share of the total mass, e^a / (e^a + e^b) = sigmoid(a - b).
    weight = torch.sigmoid(shared_lse - own_lse).unsqueeze(-1)
    return torch.lerp(own.float(), shared.float(), weight)


@dataclass
class _RowPlan:
    """A step's token rows as the native kernel's one-query sequences (see _row_plan)."""

    tables: torch.Tensor        # [T, pages] int32: each row's sequence's block table
    context_lens: torch.Tensor  # [T] int32: the keys each row sees, its own position's included


def _row_plan(meta: AttentionMetadata) -> _RowPlan:
    """Every token row of a step with prompt chunks as a sequence of one query: its sequence's block table, and
    its position + 1 keys. The kernel's arithmetic for a sequence depends on its query, its pages and its length
    alone, so a prompt's row gets the bits a decode at that position gets, whatever the chunk it came in, the
    rows beside it, or whether the keys before it were computed by this request, a cached one or a recompute."""
    if meta._row_plan is None:
        device = meta.block_tables.device
        lens = torch.tensor(meta.query_lens, device=device)
        seq = torch.repeat_interleave(torch.arange(len(meta.query_lens), device=device), lens)
        row = torch.arange(seq.numel(), device=device)
        # A sequence's last row sees its whole context; each row before it one key less.
        ends = meta.query_start_loc.to(device=device, dtype=torch.int64)[1:][seq]
        context = meta.context_lens.to(torch.int64)[seq] - (ends - 1 - row)
        meta._row_plan = _RowPlan(meta.block_tables.index_select(0, seq).contiguous(), context.to(torch.int32))
    return meta._row_plan


@dataclass
class _Chunk:
    """A prefill chunk: `length` queries at rows start.. over `context` cached keys (its own included)."""

    seq: int
    start: int
    length: int
    context: int
    mask: torch.Tensor | None  # [length, context], True where a query sees a key; None when causal from 0
    windowed: torch.Tensor | None = None  # the mask of a sliding-window layer (built on first use)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        if not window:
            return self.mask
        if self.windowed is None:
            rows = torch.arange(self.context - self.length, self.context, device=device)[:, None]
            keys = torch.arange(self.context, device=device)[None, :]
            self.windowed = (keys <= rows) & (keys > rows - window)
        return self.windowed


@dataclass
class _MixedPlan:
    """A step of prefill chunks and single-token decodes (another chat's new message arriving mid-reply):
    the decodes go through the batched decode path together, the chunks one by one."""

    decode_rows: torch.Tensor | None  # token rows of the single-token queries
    decode_meta: AttentionMetadata | None
    chunks: list[_Chunk]


def _mixed_plan(meta: AttentionMetadata, device: torch.device) -> _MixedPlan:
    if meta._mixed_plan is None:
        starts = list(itertools.accumulate(meta.query_lens, initial=0))  # each sequence's first token row
        singles = [b for b, n in enumerate(meta.query_lens) if n == 1]
        rows = torch.tensor([starts[b] for b in singles], device=device) if singles else None
        decode_meta = _subset(meta, singles, rows) if singles else None
        chunks = [_chunk(b, starts[b], qlen, ctx, device)
                  for b, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)) if qlen > 1]
        meta._mixed_plan = _MixedPlan(rows, decode_meta, chunks)
    return meta._mixed_plan


def _subset(meta: AttentionMetadata, seqs: list[int], rows: torch.Tensor) -> AttentionMetadata:
    """The metadata of single-token sequences `seqs` (token rows `rows`) as a decode-only step of their own."""
    index = torch.tensor(seqs, device=rows.device)
    ctx = [meta.context_lens_host[b] for b in seqs]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=rows.device),
        context_lens=meta.context_lens[index], block_tables=meta.block_tables[index], query_lens=[1] * len(seqs),
        context_lens_host=ctx, max_query_len=1, max_context_len=max(ctx))


def _chunk(seq: int, start: int, qlen: int, ctx: int, device: torch.device) -> _Chunk:
    if qlen == ctx:
        return _Chunk(seq, start, qlen, ctx, None)
    # Query i sits at position ctx - qlen + i and sees keys up to there.
    rows = torch.arange(ctx - qlen, ctx, device=device)[:, None]
    return _Chunk(seq, start, qlen, ctx, torch.arange(ctx, device=device)[None, :] <= rows)


def _varlen_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """Chunk by chunk: causal inside the chunk, full over the cached prefix; decodes batched (see _MixedPlan)."""
    out = torch.empty_like(q)
    plan = _mixed_plan(meta, q.device)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode_torch(q[plan.decode_rows], k_cache, v_cache, plan.decode_meta, scale, window)
    block_size = k_cache.shape[1]
    dtype = _math_dtype(q)
    for chunk in plan.chunks:
        table = meta.block_tables[chunk.seq, : -(-chunk.context // block_size)]
        k = _gather(k_cache, table, 1, chunk.context, dtype)
        v = _gather(v_cache, table, 1, chunk.context, dtype)
        rows = slice(chunk.start, chunk.start + chunk.length)
        qb = q[rows].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, heads, qlen, head_dim]
        mask = chunk.mask_for(window, q.device)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=qb.shape[1] != k.shape[1])
        out[rows] = o[0].transpose(0, 1)
    return out
