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
from slow_cases import slow_after

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
SPLIT_DECODE, SPLIT_PREFILL = 112, 48  # split_keys that cut DECODE's and the short prefills' longest contexts


def _check_attention(tk, cfg, seqs, split_keys):
    block_size, head_dim, heads, kv_heads, dtype = cfg
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE, share_pages=1)
    want = reference.paged_attention(*batch.args())
    got = tk.attn.paged_attention(*batch.args(), split_keys=split_keys)
    assert got.dtype == dtype and got.shape == batch.q.shape
    assert_close(got, want)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_decode(tk, cfg):
    _check_attention(tk, cfg, DECODE, split_keys=0)


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=CONFIG_IDS[:4])
def test_decode_split_k(tk, cfg):
    # 112 keys a split: 7 + 7 + 5 pages of a 300-token context at block 16 (4 splits at block 32), the last one
    # short; the shorter sequences take one split beside it.
    _check_attention(tk, cfg, DECODE, split_keys=SPLIT_DECODE)


# The quick run keeps d80-gqa3 here, the fewest heads to interpret: an f32 prefill after a cached prefix is in
# its quick run too, over MHA in test_a_rows_bits_are_its_own (against the reference) and test_prefill_split_k,
# over GQA in test_pages_of_another_dtype_than_q.
PREFILL_ORDER = [4, 0, 1, 2, 3]


@pytest.mark.parametrize("cfg", slow_after([(CONFIGS[i],) for i in PREFILL_ORDER]),
                         ids=[CONFIG_IDS[i] for i in PREFILL_ORDER])
def test_prefill_with_cached_prefix(tk, cfg):
    _check_attention(tk, cfg, PREFILL, split_keys=0)


@pytest.mark.parametrize("seqs,splits", slow_after([(DECODE, 0), (DECODE, SPLIT_DECODE), (PREFILL, 0),
                                                   ([(100, 9), (40, 5)], SPLIT_PREFILL)]),
                         ids=["decode", "decode-split-k", "prefill", "prefill-split-k"])
def test_sliding_window(tk, seqs, splits):
    """A sliding-window layer's attention: the kernel skips the pages before a tile's window and masks the
    rest, as the reference does."""
    block_size, head_dim, heads, kv_heads, dtype = CONFIGS[0]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE, share_pages=1)
    for window in (1, 24, 100):
        want = reference.paged_attention(*batch.args(), window)
        assert_close(tk.attn.paged_attention(*batch.args(), window, split_keys=splits), want)


@pytest.mark.parametrize("seqs,splits", [([(100, 1), (60, 1)], 0), ([(100, 1), (60, 1)], SPLIT_PREFILL),
                                         ([(100, 9), (40, 5)], 0), ([(100, 9), (40, 5)], SPLIT_PREFILL)],
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
    assert_close(tk.attn.paged_attention(*released.args(), window, split_keys=splits), want)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-pages", "int8-pages"])
@pytest.mark.parametrize("seqs,splits", [(DECODE, 0), (DECODE, SPLIT_DECODE), (PREFILL, 0)],
                         ids=["decode", "decode-split-k", "prefill"])
def test_pages_of_another_dtype_than_q(tk, kv_dtype, seqs, splits):
    """float32 queries over bf16 pages, and over int8 pages read with their scales in place (kernels/kv_pages.py):
    the reference decodes the same pages, so only the sums' order differs."""
    block_size, head_dim, heads, kv_heads, _ = CONFIGS[3]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, torch.float32, DEVICE, share_pages=1,
                       kv_dtype=kv_dtype)
    assert batch.k_cache.dtype == kv_dtype
    got = tk.attn.paged_attention(*batch.args(), 24, split_keys=splits)
    assert got.dtype == torch.float32
    assert_close(got, reference.paged_attention(*batch.args(), 24))


def test_prefill_split_k(tk):
    # The split path is generic over query tiles; the reduce runs per (token, head), so keep T small.
    _check_attention(tk, CONFIGS[0], [(100, 9), (40, 5), (16, 1)], split_keys=SPLIT_PREFILL)


def test_public_entry_point_and_empty_batch(tk):
    cfg = CONFIGS[1]
    batch = make_batch([(40, 1), (20, 1)], *cfg[2:4], cfg[1], cfg[0], cfg[4], DEVICE)
    assert_close(kernels.paged_attention(*batch.args()), reference.paged_attention(*batch.args()))
    empty = batch.q[:0]
    no_seqs = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_attention(empty, batch.k_cache, batch.v_cache, batch.block_tables[:0],
                                  no_seqs[:0], no_seqs, batch.scale, 0, 0)
    assert out.shape == empty.shape


def _rows_of(tk, batch, pieces, window, split_keys):
    """One step over batch's pages: pieces [(b, lo, hi)] are sequence b's queries lo..hi (of its query_len, the
    last at its context's end) as a sequence of the step, in that order. Returns {(b, query): output row}."""
    starts = batch.query_start_loc.tolist()
    ctx = batch.context_lens.tolist()
    qlens = [starts[b + 1] - starts[b] for b in range(len(ctx))]
    q = torch.cat([batch.q[starts[b] + lo:starts[b] + hi] for b, lo, hi in pieces])
    lens = [ctx[b] - qlens[b] + hi for b, _, hi in pieces]
    qsl = torch.tensor([0] + [hi - lo for _, lo, hi in pieces], device=DEVICE).cumsum(0).to(torch.int32)
    out = tk.attn.paged_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables[[b for b, _, _ in pieces]].contiguous(),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), qsl, batch.scale,
        max(hi - lo for _, lo, hi in pieces), max(lens), window, split_keys=split_keys)
    rows = [(b, i) for b, lo, hi in pieces for i in range(lo, hi)]
    return dict(zip(rows, out))


# (config, pages' dtype, window, split_keys): one-pass and split, causal and windowed, q's pages and int8 ones.
INVARIANCE = [(CONFIGS[0], None, 0, 0), (CONFIGS[2], None, 24, SPLIT_PREFILL),
              (CONFIGS[3], torch.int8, 0, SPLIT_PREFILL)]


@pytest.mark.parametrize("cfg,kv_dtype,window,split_keys", slow_after(INVARIANCE),
                         ids=["f32-causal", "bf16-window-split-k", "int8-pages-split-k"])
def test_a_rows_bits_are_its_own(tk, cfg, kv_dtype, window, split_keys):
    """Same request, same tokens (docs/architecture.md#same-request-same-tokens): a query row's output is the bits
    it gets as a decode alone at its position, whether it comes in a whole prompt chunk, chunks of other sizes,
    beside other sequences' prompts and decodes (a longer one that splits more), in any order."""
    block_size, head_dim, heads, kv_heads, dtype = cfg
    seqs = [(70, 12), (40, 1), (30, 16), (200, 1)]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, DEVICE, share_pages=1, kv_dtype=kv_dtype)
    alone = {}
    for i in range(12):
        alone |= _rows_of(tk, batch, [(0, i, i + 1)], window, split_keys)
    steps = [[(0, 0, 12)], [(1, 0, 1), (0, 0, 12), (2, 0, 16), (3, 0, 1)], [(3, 0, 1), (2, 0, 16), (0, 0, 12)],
             [(3, 0, 1), (0, 0, 5)], [(0, 5, 11), (1, 0, 1)], [(1, 0, 1), (0, 11, 12), (3, 0, 1)]]
    for step in steps:
        for row, got in _rows_of(tk, batch, step, window, split_keys).items():
            if row[0] == 0:
                assert torch.equal(got, alone[row]), (step, row)
    assert_close(torch.stack([alone[0, i] for i in range(12)]),
                 reference.paged_attention(*batch.args(), window)[:12])


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
def test_device_long_decode_splits_by_default(tk):
    batch = make_batch([(8192, 1)], 28, 4, 128, 16, torch.bfloat16, "cuda")
    assert_close(kernels.paged_attention(*batch.args()), reference.paged_attention(*batch.args()))
