"""Triton paged attention: every query row is a one-query sequence, decode and prompt rows alike.

Each program takes one token row and one kv head: its rows are that token's query heads of the kv group (GQA),
padded to the dot's minimum, so all of them reuse each K/V page load. Keys are visited one page (block_size
tokens) at a time through the row's sequence's block table with an online softmax, up to the row's own position.
A prompt's row is computed exactly as a decode at its position: the same compiled kernel, tile and order of sums,
over its own sequence's pages alone. So a row's bits depend on nothing but its query, its sequence's pages and
its position: not the other rows of the step, how many there are, where the prompt was cut into chunks, or
whether the pages before it came from this prefill, the prefix cache or a recompute
(docs/architecture.md#same-request-same-tokens).

Split-K ("flash-decoding") cuts a row's keys at fixed page boundaries (`split_keys`, never chosen from the
batch): each split writes an unnormalised partial result and a second kernel combines a row's own splits, in
order. Rows short enough for one split take the one-pass path, which gives the same bits as one split combined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedchat.kernels.env import interpret_env

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPU
SPLIT_KEYS = 512  # keys per split-K partition: a row with more is split, whatever the batch
# triton reads TRITON_INTERPRET when @triton.jit runs, i.e. now: record what these kernels became.
INTERPRETED = interpret_env()


# Triton compiles a variant for an int argument equal to 1 or divisible by 16; these vary with the batch, so they
# must not pick the compiled code every row runs.
@triton.jit(do_not_specialize=["pages_per_split", "split_out", "stride_bt"])
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, m_ptr, l_ptr,
    block_tables_ptr, row_seq_ptr, row_ctx_ptr,
    scale_log2e, pages_per_split, split_out, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_ot, stride_oh, stride_os,
    stride_mt, stride_mh,
    stride_bt,
    GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # the token row
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(row_seq_ptr + t).to(tl.int64)
    ctx = tl.load(row_ctx_ptr + t)  # the keys this row sees: its position + 1
    q_pos = ctx - 1

    rows = tl.arange(0, ROWS)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    page_lo = split * pages_per_split
    if window > 0:  # pages wholly before the row's window hold nothing it sees
        page_lo = tl.maximum(page_lo, tl.maximum(ctx - window, 0) // BLOCK_SIZE)
    page_hi = tl.minimum(tl.cdiv(ctx, BLOCK_SIZE), (split + 1) * pages_per_split)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_SIZE)
    for j in range(page_lo, page_hi):
        page = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        pos = j * BLOCK_SIZE + n
        # Unwritten slots of the last page may hold NaN garbage: mask them to 0 so p*V stays finite.
        kv_ok = pos < ctx
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
        seen = kv_ok & ((window == 0) | (pos > q_pos - window))
        s = tl.where(seen[None, :] & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row can be fully masked in this page (padding rows, a page before the window): keep exp2 NaN-free.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    out_off = t * stride_ot + head[:, None] * stride_oh + d[None, :]
    if split_out != 0:
        # Unnormalised partials; the reduce kernel rescales them by exp2(m - max m).
        ml_off = t * stride_mt + head * stride_mh + split
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)
        tl.store(out_ptr + out_off + split * stride_os, acc, mask=out_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only on padding rows
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_ptr, m_ptr, l_ptr, row_ctx_ptr, pages_per_split,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One (token row, head): its own splits, one after the other, so the sum's order depends on its length alone.
    Its last split holds its own key, which it sees, so the max is finite; an empty split (before a window) has
    m = -inf and weight 0."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.cdiv(tl.cdiv(tl.load(row_ctx_ptr + t), BLOCK_SIZE), pages_per_split)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    ml = m_ptr + t * stride_mt + h * stride_mh
    lp = l_ptr + t * stride_mt + h * stride_mh
    part = part_ptr + t * stride_pt + h * stride_ph + d
    m_max = tl.load(ml)
    for s in range(1, splits):
        m_max = tl.maximum(m_max, tl.load(ml + s))
    # Split 0 starts the sums (not 0 + it): one split combined is the one-pass path's acc / l, bit for bit.
    w = tl.exp2(tl.load(ml) - m_max)
    acc = tl.load(part, mask=d_ok, other=0.0) * w
    l = tl.load(lp) * w
    for s in range(1, splits):
        w = tl.exp2(tl.load(ml + s) - m_max)
        acc += tl.load(part + s * stride_ps, mask=d_ok, other=0.0) * w
        l += tl.load(lp + s) * w
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / l).to(out_ptr.dtype.element_ty), mask=d_ok)


def _scales(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An int8 cache's scales, [pages, block_size, kv_heads, 1] float32, read in place: each row's last 4 bytes
    (kernels/kv_pages.py)."""
    return cache[..., head_dim:].view(torch.float32)


def _rows(context_lens: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int,
          max_query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token row's sequence and the keys it sees (its position + 1): a sequence's last row sees its whole
    context, each row before it one key less."""
    if max_query_len <= 1:  # a decode step: row b is sequence b's one query
        return torch.arange(num_tokens, dtype=torch.int32, device=context_lens.device), context_lens
    qsl = query_start_loc.long()
    seq = torch.repeat_interleave(torch.arange(qsl.numel() - 1, device=qsl.device), qsl.diff(),
                                  output_size=num_tokens)
    row = torch.arange(num_tokens, device=qsl.device)
    ctx = context_lens.long()[seq] - (qsl[1:][seq] - 1 - row)
    return seq.to(torch.int32), ctx.to(torch.int32)


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
    split_keys: int = SPLIT_KEYS,
) -> torch.Tensor:
    """See reference.paged_attention. split_keys: a row's keys per split-K partition (rounded down to whole pages,
    at least one); 0 = never split. Fixed per model, never from the batch, so it keeps a row's bits its own."""
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
    row_seq, row_ctx = _rows(context_lens, query_start_loc, num_tokens, max_query_len)

    max_pages = triton.cdiv(max(max_context_len, 1), block_size)
    pages_per_split = max(1, split_keys // block_size) if split_keys > 0 else max_pages
    num_splits = triton.cdiv(max_pages, pages_per_split)
    if num_splits > 1:
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
    _attn_kernel[(num_tokens, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, dst, m, l,
        block_tables, row_seq, row_ctx,
        scale * LOG2E, pages_per_split, int(num_splits > 1), window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        dst.stride(0), dst.stride(1), stride_os,
        m.stride(0), m.stride(1),
        block_tables.stride(0),
        GROUP=group, ROWS=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        DOT_F32=dot_f32, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SCALED=scaled,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part, m, l, row_ctx, pages_per_split,
            out.stride(0), out.stride(1), part.stride(0), part.stride(1), part.stride(2),
            m.stride(0), m.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        )
    return out
