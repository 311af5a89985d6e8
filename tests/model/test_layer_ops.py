"""pagedchat's kernels for a float32 step's norms, rotary turn with cache write, and silu(gate) * up
(model/csrc/layer_level.cpp), on every level this CPU runs, against the torch ops the model runs otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedchat.kernels import kv_pages
from pagedchat.model import qmm
from pagedchat.model.family import Rope, RopeKind
from pagedchat.model.decoder import apply_rope, rope_table, rms_norm

LEVELS = [lv.name for lv in qmm.levels_to_build()]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,width", [(1, 576), (7, 64), (33, 20)])
def test_norm_is_torchs_rms_norm_times_the_weight(each_level, rows, width):
    x = torch.randn(rows, width, generator=_gen()) * 3
    w = torch.randn(width, generator=_gen(1))
    got = qmm.norm(x, w, 1e-5)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 13), (16, 64)])
def test_silu_mul_is_torchs(each_level, rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=_gen()) * 6  # far into both tails of silu
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(qmm.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("width", [49152, 1003, 8, 1])
def test_argmax_rows_are_torchs_max_indices(each_level, width):
    """The greedy pick: the first of tied largest values, a NaN above every number (the first NaN), an all -inf
    row's 0, -0.0 and 0.0 equal; at a vocabulary's width and at widths that are not whole vectors."""
    x = torch.randn(9, width, generator=_gen())
    x[1, [width // 2, width - 1]] = 50.0
    x[2, [width - 1, width // 3]] = float("nan")
    x[3] = float("-inf")
    x[4] = 0.0
    x[4, width // 2] = -0.0
    x[5, width - 1] = float("inf")
    x[6, width // 4] = -float("inf")
    x[7] = x[7].abs().neg()
    x[7, width - 1] = 0.0
    assert torch.equal(qmm.argmax_rows(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary", [(9, 3, 64, 64), (4, 2, 24, 12), (2, 1, 20, 20)])
def test_rope_write_turns_q_and_k_and_writes_the_cache_as_torch_does(each_level, heads, kv_heads, head_dim, rotary):
    """Bit for bit: the same products and sums, each rounded once, as apply_rope; partial rotary copies the dims
    past the turned ones; k and v land in their slots and nowhere else."""
    tokens, pages, block = 5, 4, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=_gen())
    rope = Rope(RopeKind.DEFAULT, 10000.0)
    cos_all, sin_all = rope_table(rope, rotary, 64, 64, "cpu", torch.float32)
    positions = torch.tensor([3, 17, 0, 40, 63])
    cos, sin = cos_all[positions], sin_all[positions]
    slots = torch.tensor([5, 60, 17, 33, 2])
    k_cache = torch.full((pages, block, kv_heads, head_dim), 7.0)
    v_cache = torch.full((pages, block, kv_heads, head_dim), 7.0)
    q = qmm.rope_write(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads)

    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    turned = apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))
    assert torch.equal(q, turned[:, :heads])
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots], turned[:, heads:])
    assert torch.equal(flat_v[slots], qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim))
    untouched = torch.ones(pages * block, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-pages", "int8-pages"])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_rope_write_into_pages_of_another_dtype_is_kv_pages_encode(each_level, kv_dtype, head_dim):
    """Into bf16 or int8 pages the kernel writes what the torch path's write does (kv_pages.encode: bf16 rounded to
    nearest even, int8 codes and scale), bit for bit, so both paths hold the same pages; q is the same."""
    heads, kv_heads, tokens = 6, 2, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=_gen()) * 3
    qkv[0, (heads + kv_heads) * head_dim :] = 0.0  # a value row of zeros: scale 0, codes 0
    cos_all, sin_all = rope_table(Rope(RopeKind.DEFAULT, 10000.0), head_dim, 64, 64, "cpu", torch.float32)
    positions = torch.tensor([3, 17, 0, 40, 63])
    cos, sin = cos_all[positions], sin_all[positions]
    slots = torch.tensor([5, 60, 17, 33, 2])
    k32, v32 = torch.zeros(2, 4, 16, kv_heads, head_dim)
    q32 = qmm.rope_write(qkv, cos, sin, slots, k32, v32, heads, kv_heads)
    shape = (4, 16, kv_heads, kv_pages.row_width(head_dim, kv_dtype))
    k_pages, v_pages = torch.zeros(2, *shape, dtype=kv_dtype)
    q = qmm.rope_write(qkv, cos, sin, slots, k_pages, v_pages, heads, kv_heads)
    assert torch.equal(q, q32)
    for pages, floats in ((k_pages, k32), (v_pages, v32)):
        assert torch.equal(pages, kv_pages.encode(floats, kv_dtype))


def test_the_ops_refuse_what_they_cannot_read(kernels):
    kernels(LEVELS[-1])
    with pytest.raises(RuntimeError, match="contiguous float32"):
        qmm.norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="gate and up side by side"):
        qmm.silu_mul(torch.randn(2, 7))
    cache = torch.zeros(2, 16, 1, 8)  # 32 slots
    cos = sin = torch.ones(1, 8)
    with pytest.raises(RuntimeError, match="slot 32 lies outside a cache of 32"):
        qmm.rope_write(torch.randn(1, 24), cos, sin, torch.tensor([32]), cache, cache.clone(), 1, 1)
    with pytest.raises(RuntimeError, match="reads page 2 of a pool of 2"):
        qmm.attend(torch.randn(1, 1, 8), cache, cache.clone(), torch.tensor([[0, 2]], dtype=torch.int32),
                   torch.tensor([20], dtype=torch.int32), 1.0, 0)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        qmm.attend(torch.randn(1, 1, 8), cache, cache.clone(), torch.tensor([[0]], dtype=torch.int32),
                   torch.tensor([17], dtype=torch.int32), 1.0, 0)
