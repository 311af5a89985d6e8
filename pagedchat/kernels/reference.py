"""Plain torch reference implementations of the paged KV-cache ops: these are the spec.

Slow on purpose (a Python loop per token / sequence) so that each line can be checked by eye.
The Triton kernels are tested against these, and these against dense SDPA on contiguous K/V.

Layout: a cache is `[num_pages, block_size, num_kv_heads, row]`; slot = page * block_size + offset; a row is
head_dim elements of the pages' dtype, or an int8 page's codes and scale (kernels/kv_pages.py).
"""

from __future__ import annotations

import torch

from pagedchat.kernels import kv_pages


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token t's K/V (`[T, num_kv_heads, head_dim]`) in slot `slot_mapping[t]`; slot -1 = skip."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, block_size)
        k_cache[page, offset] = kv_pages.encode(k[t], k_cache.dtype)
        v_cache[page, offset] = kv_pages.encode(v[t], v_cache.dtype)


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
) -> torch.Tensor:
    """Causal attention of a varlen query batch over K/V stored in pages.

    Sequence b owns queries `q[query_start_loc[b]:query_start_loc[b+1]]` and `context_lens[b]` cached
    tokens, the last `qlen` of which are this step's own tokens. Query j sits at position
    `context_len - qlen + j` and sees keys `0..position`, or with a window > 0 the last `window` of them
    (`position - window + 1..position`, a sliding-window layer). max_query_len / max_context_len are only
    launch hints for the kernels; the reference ignores them.
    """
    del max_query_len, max_context_len
    num_tokens, num_heads, head_dim = q.shape  # the caches' rows: head_dim, or int8 codes and their scale
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        qlen = end - start
        if qlen == 0:
            continue
        pages = block_tables[b, : (ctx + block_size - 1) // block_size].long()
        # Gather this sequence's pages into contiguous [ctx, kv_heads, head_dim], then expand GQA.
        k = kv_pages.decode(k_cache[pages], torch.float32).reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = kv_pages.decode(v_cache[pages], torch.float32).reshape(-1, num_kv_heads, head_dim)[:ctx]
        k = k.repeat_interleave(group, dim=1)  # query head h -> kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        causal = k_pos[None, :] <= q_pos[:, None]  # [qlen, ctx]
        if window > 0:
            causal &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out

