"""Triton KV-cache data movement: scatter new tokens into their slots. (Page copies, for copy-on-write and
swapping, are one torch indexing op over every layer at once in the model runner.)

The kernel moves bits, never values: tensors are reinterpreted as same-width integers, which keeps it
dtype-agnostic (and lets bf16 run under the interpreter, which has no real bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedchat.kernels.env import interpret_env

# triton reads TRITON_INTERPRET when @triton.jit runs, i.e. now: record what these kernels became.
INTERPRETED = interpret_env()
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # slot -1: a token with nothing to store (e.g. its page is shared), skip
        page = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_DIM_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + page * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask)
        tl.store(v_cache_ptr + page * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """See reference.write_kv. k/v may be strided views (e.g. of a fused qkv), last dim contiguous."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "write_kv copies bits: dtypes must match"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.stride(0) == 1
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    k, v, kc, vc = (_as_bits(x) for x in (k, v, k_cache, v_cache))
    _write_kv_kernel[(num_tokens,)](
        k, v, kc, vc, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )

