"""Triton paged attention: one kernel for decode and prefill chunks, optional split-K ("flash-decoding").

Each program takes one sequence, one kv head and a tile of query tokens. Its rows are
(token, query head of that kv group) pairs, so all query heads sharing a kv head reuse each K/V page
load (GQA), and decode (1 token) and prefill (many) are the same code with a different tile height.
Keys are visited one page (block_size tokens) at a time through the block table with an online
softmax. With split-K the pages of a sequence are partitioned over several programs, each writing an
unnormalised partial result, and a second kernel combines them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedchat.kernels.env import interpret_env

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPU
PREFILL_ROWS = 64  # rows (tokens x heads) per program for prefill tiles
MAX_SPLITS = 128  # bounds the reduce kernel's [splits, head_dim] tile
# triton reads TRITON_INTERPRET when @triton.jit runs, i.e. now: record what these kernels became.
INTERPRETED = interpret_env()


@triton.jit
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, m_ptr, l_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    scale_log2e, pages_per_split, num_splits, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_ot, stride_oh, stride_os,
    stride_mt, stride_mh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    ROWS: tl.constexpr = TOKENS * GROUP_PAD
    rows = tl.arange(0, ROWS)
    tok = q_tile * TOKENS + rows // GROUP_PAD  # token index within the sequence's chunk
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows % GROUP_PAD < GROUP) & (tok < q_len)
    q_pos = ctx - q_len + tok  # absolute position: sees keys 0..q_pos
    t_idx = (q_start + tok).to(tl.int64)

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys up to the tile's last query position; a tile past the chunk's end has nothing to do.
    kv_end = tl.minimum(ctx, ctx - q_len + (q_tile + 1) * TOKENS)
    kv_end = tl.where(q_tile * TOKENS < q_len, kv_end, 0)
    page_lo = 0
    if window > 0:  # pages wholly before the window of the tile's first query hold nothing it sees
        page_lo = tl.maximum(ctx - q_len + q_tile * TOKENS - window + 1, 0) // BLOCK_SIZE
    page_hi = tl.cdiv(kv_end, BLOCK_SIZE)
    if SPLIT:
        page_lo = split * pages_per_split
        page_hi = tl.minimum(page_hi, page_lo + pages_per_split)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_SIZE)
    for j in range(page_lo, page_hi):
        page = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        pos = j * BLOCK_SIZE + n
        # Unwritten slots of the last page may hold NaN garbage: mask them to 0 so p*V stays finite.
        kv_ok = pos < kv_end
        k_t = tl.load(k_cache_ptr + page * stride_kb + n[None, :] * stride_ks + kv_head * stride_kh
                      + d[:, None], mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + page * stride_vb + n[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if SCALED:  # int8 pages: each (token, KV head) row's codes times its scale
            scale_off = page * stride_sb + n * stride_ss + kv_head * stride_sh
            k_t = k_t.to(tl.float32) * tl.load(k_scale_ptr + scale_off, mask=kv_ok, other=0.0)[None, :]
            v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_off, mask=kv_ok, other=0.0)[:, None]
        elif DOT_F32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2e  # log2 units for exp2
        seen = (pos[None, :] <= q_pos[:, None]) & ((window == 0) | (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(seen & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row can be fully masked in this page (padding rows, early tokens): keep exp2 NaN-free.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    out_off = t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        # Unnormalised partials; the reduce kernel rescales them by exp2(m - max m).
        ml_off = t_idx * stride_mt + head * stride_mh + split
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)
        tl.store(out_ptr + out_off + split * stride_os, acc, mask=out_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on masked rows
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_ptr, m_ptr, l_ptr, num_splits,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    m = tl.load(m_ptr + t * stride_mt + h * stride_mh + s, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + t * stride_mt + h * stride_mh + s, mask=s_ok, other=0.0)
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    # Split 0 always holds key 0, which every query sees, so the max is finite; empty splits
    # (m = -inf) get weight 0.
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _scales(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An int8 cache's scales, [pages, block_size, kv_heads, 1] float32, read in place: each row's last 4 bytes
    (kernels/kv_pages.py)."""
    return cache[..., head_dim:].view(torch.float32)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_query_len: int, max_context_len: int,
                      device: torch.device) -> int:
    """Split-K only pays when a decode batch has too few (sequence, kv head) programs to fill the
    GPU and contexts are long enough that each split still streams >= 256 keys."""
    if device.type != "cuda" or max_query_len != 1 or max_context_len < 1024:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    programs = batch * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(2 * sms // programs, max_context_len // 256, MAX_SPLITS))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    window: int = 0,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """See reference.paged_attention. num_splits: None = heuristic, 1 = off, n > 1 = split-K into
    (about) n partitions of each sequence's pages (tests force it)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = context_lens.shape[0]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, "num_heads must be a multiple of num_kv_heads"
    assert block_size >= MIN_DOT and block_size & (block_size - 1) == 0, "block_size: power of 2 >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens),
                    ("query_start_loc", query_start_loc)):
        assert t.dtype == torch.int32, f"{name} must be int32"
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out

    group_pad = triton.next_power_of_2(group)
    if max_query_len <= 1:
        tokens = max(1, MIN_DOT // group_pad)  # one real token; pad rows up to the dot minimum
    else:
        tokens = max(1, PREFILL_ROWS // group_pad)
    q_tiles = triton.cdiv(max(max_query_len, 1), tokens)

    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_query_len, max_context_len, q.device)
    max_pages = triton.cdiv(max(max_context_len, 1), block_size)
    num_splits = max(1, min(num_splits, max_pages, MAX_SPLITS))
    pages_per_split = triton.cdiv(max_pages, num_splits)
    num_splits = triton.cdiv(max_pages, pages_per_split)
    split = num_splits > 1

    if split:
        part = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        dst, stride_os = part, part.stride(2)
    else:
        m = l = out  # unused
        dst, stride_os = out, 0

    # The interpreter keeps bf16 as raw uint16 and its dot would multiply the bits: upcast there; and pages of
    # another dtype than q's (kernels/kv_pages.py) meet q in float32.
    scaled = k_cache.dtype == torch.int8
    dot_f32 = q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16) or k_cache.dtype != q.dtype
    k_scale, v_scale = (_scales(c, head_dim) for c in (k_cache, v_cache)) if scaled else (k_cache, v_cache)
    head_dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    _attn_kernel[(batch, num_kv_heads, q_tiles * num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, dst, m, l,
        block_tables, context_lens, query_start_loc,
        scale * LOG2E, pages_per_split, num_splits, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        dst.stride(0), dst.stride(1), stride_os,
        m.stride(0), m.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, TOKENS=tokens,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        SPLIT=split, DOT_F32=dot_f32, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SCALED=scaled,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part, m, l, num_splits,
            out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
            m.stride(0), m.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
