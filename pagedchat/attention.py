"""The one place attention meets the paged KV cache.

`write_kv` puts a step's new K/V into their slots; `paged_attention` reads K/V back through the block
tables. Both pick the torch path (CPU, and anywhere Triton is missing) or the Triton kernels (CUDA) here and
nowhere else. PAGEDCHAT_ATTENTION=torch|triton forces either, for tests and comparison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    # Per-step values the torch decode path would otherwise rebuild in every layer.
    _decode_inputs: dict = field(default_factory=dict, repr=False)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def backend(device: torch.device) -> str:
    forced = os.environ.get("PAGEDCHAT_ATTENTION", "").lower()
    if forced in ("torch", "triton"):
        return forced
    if device.type == "cuda":
        from pagedchat.kernels import triton_available

        if triton_available():
            return "triton"
    return "torch"


def write_kv(k_cache, v_cache, k, v, meta: AttentionMetadata, use_triton: bool) -> None:
    if use_triton:
        from pagedchat.kernels import write_kv as triton_write_kv

        triton_write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return
    # The cache is [pages, block_size, kv_heads, head_dim]: flattening the first two makes slots direct rows.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, use_triton: bool) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim], causal over each sequence's cached context."""
    if use_triton:
        from pagedchat.kernels import paged_attention as triton_attention

        return triton_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
                                scale, meta.max_query_len, meta.max_context_len)
    if meta.decode_only:
        return _decode_torch(q, k_cache, v_cache, meta, scale)
    return _varlen_torch(q, k_cache, v_cache, meta, scale)


def _gather(cache: torch.Tensor, flat_tables: torch.Tensor, b: int, length: int, dtype,
            out: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Flattened [B * pages] tables -> [B, kv_heads, length, head_dim] keys or values, in logical order.

    `out` is (raw, upcast) buffers to gather into, reused across layers so each step allocates them once."""
    # index_select on the flattened table is several times faster than advanced indexing on the CPU.
    if out is None:
        pages = cache.index_select(0, flat_tables).to(dtype)
    else:
        raw, upcast = out
        pages = torch.index_select(cache, 0, flat_tables, out=raw)
        if upcast is not raw:
            pages = upcast.copy_(raw)
    _, bs, h, d = pages.shape
    return pages.view(b, -1, h, d)[:, :length].transpose(1, 2)


def _math_dtype(q: torch.Tensor) -> torch.dtype:
    """fp16 attention on the CPU has no fast kernel, so it is upcast. bf16 stays bf16 (the flash kernel
    accumulates in fp32, as transformers' bf16 sdpa does): at 16 chats that skips copying every gathered
    page to fp32: 30 layers of decode attention took 44 -> 36 ms here, while prefill costs the same either way."""
    return torch.float32 if q.device.type == "cpu" and q.dtype == torch.float16 else q.dtype


def _decode_inputs(meta: AttentionMetadata, cache: torch.Tensor, dtype: torch.dtype) -> dict:
    """The step's flat block table, mask and gather buffers, built by the first layer and reused by the rest."""
    if not meta._decode_inputs:
        block_size, length = cache.shape[1], meta.max_context_len
        tables = meta.block_tables[:, : -(-length // block_size)]
        flat = tables.reshape(-1)
        positions = torch.arange(length, device=cache.device)
        mask = (positions[None, :] < meta.context_lens[:, None].to(positions.dtype))[:, None, None, :]
        shape = (flat.numel(), *cache.shape[1:])

        def buffers() -> tuple[torch.Tensor, torch.Tensor]:
            raw = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            return raw, raw if dtype == cache.dtype else torch.empty(shape, dtype=dtype, device=cache.device)

        meta._decode_inputs.update(flat=flat, mask=mask, k=buffers(), v=buffers())
    return meta._decode_inputs


def _decode_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """All sequences at once: one query each, keys padded to the longest context and masked.

    Grouped-query heads that share a KV head become that head's query rows ([B, kv_heads, group, D]), so
    no K/V is repeated and one attention call serves the group."""
    dtype, (b, heads, d), length = _math_dtype(q), q.shape, meta.max_context_len
    step = _decode_inputs(meta, k_cache, dtype)
    k = _gather(k_cache, step["flat"], b, length, dtype, step["k"])
    v = _gather(v_cache, step["flat"], b, length, dtype, step["v"])
    kv_heads = k.shape[1]
    queries = q.reshape(b, kv_heads, heads // kv_heads, d).to(dtype)
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=step["mask"], scale=scale)
    return out.reshape(b, heads, d).to(q.dtype)


def _varlen_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Sequence by sequence: causal inside the chunk, full over the cached prefix."""
    out = torch.empty_like(q)
    start = 0
    block_size = k_cache.shape[1]
    dtype = _math_dtype(q)
    for b, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
        table = meta.block_tables[b, : -(-ctx // block_size)]
        k = _gather(k_cache, table, 1, ctx, dtype)
        v = _gather(v_cache, table, 1, ctx, dtype)
        qb = q[start : start + qlen].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, heads, qlen, head_dim]
        if qlen == ctx:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale,
                                               enable_gqa=qb.shape[1] != k.shape[1])
        else:
            # Query i sits at position ctx - qlen + i and sees keys up to there.
            rows = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=qb.shape[1] != k.shape[1])
        out[start : start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out
