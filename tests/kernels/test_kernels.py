"""Paged KV-cache kernels: the reference against dense SDPA, the Triton kernels against the reference.

Without a GPU the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set only while this
module's kernel tests run); shapes are pruned so that stays fast. With CUDA the same tests run on
the device, plus `gpu`-marked checks at real model shapes.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedchat import kernels
from pagedchat.kernels import reference
from pagedchat.kernels.check import make_batch
from pagedchat.kernels import kv_pages
from pagedchat.model import attention
from pagedchat.model.attention import AttentionMetadata

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# (atol, rtol) per dtype: the kernels round P to the input dtype before P @ V, as flash attention does.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def assert_close(got, want):
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)  # NaN anywhere fails


@pytest.fixture(scope="module")
def tk():
    """The Triton kernel modules; without CUDA, built for the interpreter.

    triton picks interpreted-or-compiled when @triton.jit runs, i.e. at import, for our kernels and
    for its own library (tl.max, tl.sum...). So TRITON_INTERPRET=1 is set (for this module's tests
    only, so the rest of the suite still sees no usable Triton) before triton is first imported,
    and our modules are reloaded if something imported them before.
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    names = ("pagedchat.kernels.triton_attention", "pagedchat.kernels.cache_ops")
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            early = "triton.language" in sys.modules and not kernels.interpret_env()
            mp.setenv("TRITON_INTERPRET", "1")
            if early and type(sys.modules["triton.language"].zeros).__name__ != "InterpretedFunction":
                pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its library "
                            "cannot run in the interpreter: export TRITON_INTERPRET=1 for this run")
        mods = [importlib.import_module(n) for n in names]
        mods = [importlib.reload(m) if m.INTERPRETED != (not CUDA) else m for m in mods]
        yield SimpleNamespace(attn=mods[0], ops=mods[1])


# ---------------------------------------------------------------------------- reference vs dense


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2), (16, 2)])
def test_reference_matches_dense_causal_sdpa(block_size, heads, kv_heads):
    """Each sequence's output rows equal full causal SDPA over its contiguous K/V, queried at every
    position, keeping the last qlen rows: no paging, no bottom-right mask logic of our own."""
    seqs = [(300, 40), (17, 17), (16, 1), (1, 1), (15, 3)]
    batch = make_batch(seqs, heads, kv_heads, 64, block_size, share_pages=1)
    out = reference.paged_attention(*batch.args())
    for b, (ctx, qlen) in enumerate(seqs):
        start = batch.query_start_loc[b].item()
        q_prefix = torch.randn(ctx - qlen, heads, 64)  # earlier positions' queries: any values
        q_full = torch.cat([q_prefix, batch.q[start:start + qlen]])
        dense = F.scaled_dot_product_attention(
            q_full.transpose(0, 1), batch.keys[b].transpose(0, 1), batch.values[b].transpose(0, 1),
            is_causal=True, scale=batch.scale, enable_gqa=heads != kv_heads,
        ).transpose(0, 1)
        torch.testing.assert_close(out[start:start + qlen], dense[ctx - qlen:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 20, 64])
def test_reference_window_matches_dense_sliding_sdpa(window):
    """With a window, query at position p sees keys p - window + 1 .. p: dense SDPA under that band mask."""
    seqs = [(300, 40), (17, 17), (70, 1)]
    batch = make_batch(seqs, 4, 2, 32, 16, share_pages=1)
    out = reference.paged_attention(*batch.args(), window)
    for b, (ctx, qlen) in enumerate(seqs):
        start = batch.query_start_loc[b].item()
        rows = torch.arange(ctx - qlen, ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        band = (keys <= rows) & (keys > rows - window)
        dense = F.scaled_dot_product_attention(
            batch.q[start:start + qlen].transpose(0, 1), batch.keys[b].transpose(0, 1),
            batch.values[b].transpose(0, 1), attn_mask=band, scale=batch.scale, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[start:start + qlen], dense, atol=1e-5, rtol=1e-5)


def test_reference_write_kv():
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.write_kv(k_cache, v_cache, k, v, torch.tensor([17, -1, 63]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[3, 15], v[2])
    assert k_cache.count_nonzero() == k[0].count_nonzero() + k[2].count_nonzero()


# ---------------------------------------------------------------------------- attention kernels

# (block_size, head_dim, heads, kv_heads, dtype): every block size, head dim, GQA ratio 1/3/4/8 and
# dtype appears, without the full cross product. head_dim 80 checks the padded (non-power-of-2) path.
CONFIGS = [
    (16, 64, 4, 4, torch.float32),
    (32, 128, 9, 3, torch.float16),
    (16, 128, 8, 2, torch.bfloat16),
    (32, 64, 16, 2, torch.float32),
    (16, 80, 3, 1, torch.float16),
]
CONFIG_IDS = ["bs16-d64-mha-f32", "bs32-d128-gqa3-f16", "bs16-d128-gqa4-bf16", "bs32-d64-gqa8-f32",
              "bs16-d80-gqa3-f16"]
# (context_len, query_len): sequence 1 shares sequence 0's first page.
DECODE = [(300, 1), (17, 1), (1, 1), (15, 1), (16, 1)]
PREFILL = [(300, 40), (33, 33), (16, 1), (17, 17), (47, 2)]  # chunks after a cached prefix, mixed


def _check_attention(tk, cfg, seqs, num_splits):
    block_size, head_dim, heads, kv_heads, dtype = cfg
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE, share_pages=1)
    want = reference.paged_attention(*batch.args())
    got = tk.attn.paged_attention(*batch.args(), num_splits=num_splits)
    assert got.dtype == dtype and got.shape == batch.q.shape
    assert_close(got, want)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_decode(tk, cfg):
    _check_attention(tk, cfg, DECODE, num_splits=1)


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=CONFIG_IDS[:4])
def test_decode_split_k(tk, cfg):
    # 3 splits of a 19-page context: the last split is short, short sequences leave splits empty.
    _check_attention(tk, cfg, DECODE, num_splits=3)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_prefill_with_cached_prefix(tk, cfg):
    _check_attention(tk, cfg, PREFILL, num_splits=1)


@pytest.mark.parametrize("seqs,splits", [(DECODE, 1), (DECODE, 3), (PREFILL, 1), ([(100, 9), (40, 5)], 2)],
                         ids=["decode", "decode-split-k", "prefill", "prefill-split-k"])
def test_sliding_window(tk, seqs, splits):
    """A sliding-window layer's attention: the kernel skips the pages before a tile's window and masks the
    rest, as the reference does."""
    block_size, head_dim, heads, kv_heads, dtype = CONFIGS[0]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE, share_pages=1)
    for window in (1, 24, 100):
        want = reference.paged_attention(*batch.args(), window)
        assert_close(tk.attn.paged_attention(*batch.args(), window, num_splits=splits), want)


@pytest.mark.parametrize("seqs,splits", [([(100, 1), (60, 1)], 1), ([(100, 1), (60, 1)], 3),
                                         ([(100, 9), (40, 5)], 1), ([(100, 9), (40, 5)], 2)],
                         ids=["decode", "decode-split-k", "prefill", "prefill-split-k"])
def test_blocks_a_window_released_may_point_at_a_zero_null_page(tk, seqs, splits):
    """The engine points a block every window of its sequence has passed at its layer group's null page, never
    written, all zeros (engine/model_runner.py): the reference and the kernels give the same output with it in
    place of those pages, whether they skip it or read it masked (a split before the window)."""
    block_size, head_dim, heads, kv_heads, dtype = CONFIGS[0]
    window = 24
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE)
    want = reference.paged_attention(*batch.args(), window)
    null = batch.k_cache.shape[0]
    tables = batch.block_tables.clone()
    for b, (ctx, qlen) in enumerate(seqs):  # the pages before the first query's window, as the engine releases
        tables[b, : max(0, ctx - qlen - window + 1) // block_size] = null
    assert (tables == null).sum() >= 4
    released = dataclasses.replace(batch, block_tables=tables,
                                   k_cache=torch.cat([batch.k_cache, torch.zeros_like(batch.k_cache[:1])]),
                                   v_cache=torch.cat([batch.v_cache, torch.zeros_like(batch.v_cache[:1])]))
    assert_close(reference.paged_attention(*released.args(), window), want)
    assert_close(tk.attn.paged_attention(*released.args(), window, num_splits=splits), want)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-pages", "int8-pages"])
@pytest.mark.parametrize("seqs,splits", [(DECODE, 1), (DECODE, 3), (PREFILL, 1)],
                         ids=["decode", "decode-split-k", "prefill"])
def test_pages_of_another_dtype_than_q(tk, kv_dtype, seqs, splits):
    """float32 queries over bf16 pages, and over int8 pages read with their scales in place (kernels/kv_pages.py):
    the reference decodes the same pages, so only the sums' order differs."""
    block_size, head_dim, heads, kv_heads, _ = CONFIGS[3]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, torch.float32, DEVICE, share_pages=1,
                       kv_dtype=kv_dtype)
    assert batch.k_cache.dtype == kv_dtype
    got = tk.attn.paged_attention(*batch.args(), 24, num_splits=splits)
    assert got.dtype == torch.float32
    assert_close(got, reference.paged_attention(*batch.args(), 24))


def test_prefill_split_k(tk):
    # The split path is generic over query tiles; the reduce runs per (token, head), so keep T small.
    _check_attention(tk, CONFIGS[0], [(100, 9), (40, 5), (16, 1)], num_splits=2)


def test_public_entry_point_and_empty_batch(tk):
    cfg = CONFIGS[1]
    batch = make_batch([(40, 1), (20, 1)], *cfg[2:4], cfg[1], cfg[0], cfg[4], DEVICE)
    assert_close(kernels.paged_attention(*batch.args()), reference.paged_attention(*batch.args()))
    empty = batch.q[:0]
    no_seqs = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_attention(empty, batch.k_cache, batch.v_cache, batch.block_tables[:0],
                                  no_seqs[:0], no_seqs, batch.scale, 0, 0)
    assert out.shape == empty.shape


def test_split_heuristic(tk, monkeypatch):
    monkeypatch.setattr(tk.attn, "_sm_count", lambda index: 132)
    choose = tk.attn.choose_num_splits
    cuda = torch.device("cuda", 0)
    assert choose(1, 4, 1, 16384, cuda) > 1  # one long decode: split
    assert choose(64, 4, 1, 16384, cuda) == 1  # enough programs already
    assert choose(1, 4, 1, 300, cuda) == 1  # short context
    assert choose(1, 4, 512, 16384, cuda) == 1  # prefill
    assert choose(1, 4, 1, 16384, torch.device("cpu")) == 1


# ---------------------------------------------------------------------------- cache ops


@pytest.mark.parametrize("block_size,kv_heads,head_dim,dtype", [
    (16, 3, 64, torch.float16), (32, 4, 128, torch.bfloat16), (16, 1, 128, torch.float32),
    (32, 8, 64, torch.float16),
])
def test_write_kv(tk, block_size, kv_heads, head_dim, dtype):
    num_pages, t = 6, 40
    gen = torch.Generator().manual_seed(1)
    # k and v as strided views into a fused qkv projection, as the engine produces them.
    qkv = torch.randn(t, 5 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 3 * kv_heads:4 * kv_heads], qkv[:, 4 * kv_heads:]
    slots = torch.randperm(num_pages * block_size, generator=gen)[:t].to(DEVICE)
    slots[::7] = -1
    want = [torch.randn(num_pages, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
            for _ in range(2)]
    got = [c.clone() for c in want]
    reference.write_kv(*want, k, v, slots)
    tk.ops.write_kv(*got, k, v, slots)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-pages", "int8-pages"])
def test_write_kv_into_pages_of_another_dtype(tk, kv_dtype):
    """The engine's write (model/attention.py) converts or quantizes float32 K/V, then the kernel moves the rows'
    bits: the same bytes as the reference's write, an int8 row's scale included."""
    num_pages, block_size, kv_heads, head_dim, t = 4, 16, 3, 64, 20
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(t, kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2))
    slots = torch.randperm(num_pages * block_size, generator=gen)[:t].to(DEVICE)
    shape = (num_pages, block_size, kv_heads, kv_pages.row_width(head_dim, kv_dtype))
    want = [torch.zeros(shape, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
    got = [c.clone() for c in want]
    reference.write_kv(*want, k, v, slots)
    meta = AttentionMetadata(slots, *[None] * 3, [], [], 1, 1)
    attention.write_kv(*got, k, v, meta, "triton")
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(kv_pages.decode(want[0].view(-1, kv_heads, shape[-1])[slots], torch.float32),
                       kv_pages.decode(kv_pages.encode(k, kv_dtype), torch.float32))


# ---------------------------------------------------------------------------- packaging and device


def test_pagedchat_kernels_imports_and_no_top_level_kernels(monkeypatch):
    assert isinstance(kernels.triton_available(), bool)
    assert Path(kernels.__file__).resolve().parent == REPO / "pagedchat" / "kernels"
    # transformers imports an unrelated distribution named `kernels`: nothing at the repo's top may stand in
    # for it, even with the repo root (a `python -m pytest` cwd) first on sys.path. A virtualenv inside the
    # checkout, as the README makes, may hold the real one.
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin or "/").resolve().parent != REPO / "kernels", spec
    assert not (REPO / "kernels").exists()


def test_imports_without_triton():
    # As on macOS: the package and its reference must import, and report Triton unavailable.
    code = ("import sys; sys.modules['triton'] = None  # `import triton` now fails\n"
            "import pagedchat.kernels as k, pagedchat.kernels.check\n"
            "assert not k.triton_available()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@gpu
@needs_cuda
def test_device_check_realistic_shapes(tk):
    """The same comparison as `python -m pagedchat.kernels.check` at SmolLM2 / Qwen2.5-7B shapes."""
    from pagedchat.kernels import check

    assert check.check_correctness("cuda", check.MODELS, (torch.float16, torch.bfloat16),
                                   check.MIXED, check.PREFILL)


@gpu
@needs_cuda
def test_device_heuristic_split_long_decode(tk):
    batch = make_batch([(8192, 1)], 28, 4, 128, 16, torch.bfloat16, "cuda")
    assert tk.attn.choose_num_splits(1, 4, 1, 8192, torch.device("cuda")) > 1
    assert_close(kernels.paged_attention(*batch.args()), reference.paged_attention(*batch.args()))
