"""The CPU attention paths against the reference, on paged batches: torch's (and wherever Triton is missing),
and pagedchat's native decode kernel (model/csrc/layer_level.cpp) on every level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from pagedchat.kernels import reference
from pagedchat.kernels.check import make_batch
from pagedchat.model import attention, qmm
from pagedchat.model.attention import AttentionMetadata

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # atol = rtol
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _run(seqs, dtype, share_pages=0, heads=6, kv_heads=2, window=None, path="torch", head_dim=64, kv_dtype=None):
    """The path's output, the reference's, and the step's plan (decode or mixed; the torch path's); window: a
    sliding window layer's; kv_dtype: the pages' (kernels/kv_pages.py), dtype's by default."""
    batch = make_batch(seqs, heads, kv_heads, head_dim, 16, dtype, share_pages=share_pages, kv_dtype=kv_dtype)
    if path == "torch":
        # The torch path reads padding slots and masks them out; the engine's cache starts zeroed, so do the
        # same with the NaN that make_batch leaves there (an int8 row's in its scale). The native kernel must
        # never read them.
        for cache in (batch.k_cache, batch.v_cache):
            floats = cache[..., head_dim:].view(torch.float32) if cache.dtype == torch.int8 else cache
            floats.nan_to_num_(0.0)
    qlens = [q for _, q in seqs]
    ctx = [c for c, _ in seqs]
    tables = batch.block_tables.tolist()
    slots = [tables[b][p // 16] * 16 + p % 16 for b, (c, q) in enumerate(seqs) for p in range(c - q, c)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=batch.query_start_loc,
        context_lens=batch.context_lens, block_tables=batch.block_tables, query_lens=qlens,
        context_lens_host=ctx, max_query_len=max(qlens), max_context_len=max(ctx))
    got = attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale, path, window=window)
    want = reference.paged_attention(*batch.args(), window or 0)
    assert got.dtype == dtype and got.shape == batch.q.shape
    return got, want, meta._decode_plans.get(window) or meta._mixed_plan


def _assert_close(got, want):
    tol = TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@DTYPES
def test_decode_over_padded_contexts(dtype):
    got, want, plan = _run([(100, 1), (70, 1), (1, 1), (33, 1), (16, 1)], dtype)
    assert plan.prefix_tables is None
    _assert_close(got, want)


@DTYPES
def test_prefill_chunks_beside_decodes(dtype):
    """A mixed step: chunks after a cached prefix and from scratch, decodes batched apart from them."""
    got, want, plan = _run([(90, 23), (70, 1), (40, 40), (16, 1), (5, 5)], dtype)
    assert plan.decode_rows.tolist() == [23, 64]
    assert [(c.start, c.length, c.mask is None) for c in plan.chunks] == [(0, 23, False), (24, 40, True),
                                                                          (65, 5, True)]
    _assert_close(got, want)


@DTYPES
@pytest.mark.parametrize("seqs,shared_tokens", [
    ([(100, 1), (70, 1), (90, 1), (50, 1)], 48),
    # A context that ends on the shared prefix's last page keeps that page as its own: its query's own key
    # must stay in the part it reads alone.
    ([(100, 1), (48, 1), (90, 1)], 32),
])
def test_decode_reads_a_shared_prefix_once(monkeypatch, dtype, seqs, shared_tokens):
    monkeypatch.setattr(attention, "SHARED_PREFIX_MIN_SAVED_KEYS", 0)
    got, want, plan = _run(seqs, dtype, share_pages=3)
    assert plan.prefix_len == shared_tokens
    assert plan.length == max(c for c, _ in seqs) - shared_tokens
    _assert_close(got, want)


def test_shared_prefix_only_where_it_saves_enough():
    seqs = [(100, 1), (70, 1), (90, 1), (50, 1)]  # 3 sequences x 48 shared tokens: too few keys saved
    got, want, plan = _run(seqs, torch.float32, share_pages=3)
    assert plan.prefix_tables is None
    _assert_close(got, want)
    many = [(60 + i, 1) for i in range(40)]  # 39 x 48 keys saved
    got, want, plan = _run(many, torch.float32, share_pages=3)
    assert plan.prefix_len == 48
    _assert_close(got, want)


@DTYPES
@pytest.mark.parametrize("window", [1, 20, 48])
def test_sliding_window_decode_and_chunks(monkeypatch, dtype, window):
    """A windowed layer sees the last `window` keys only, in decodes (reading from the first page any window
    reaches, never the shared-prefix split) and in prefill chunks beside them."""
    monkeypatch.setattr(attention, "SHARED_PREFIX_MIN_SAVED_KEYS", 0)
    got, want, plan = _run([(100, 1), (70, 1), (90, 1), (50, 1)], dtype, share_pages=3, window=window)
    assert plan.prefix_tables is None and plan.length == 100 - (50 - window) // 16 * 16
    _assert_close(got, want)
    got, want, _ = _run([(90, 23), (70, 1), (40, 40), (16, 1), (5, 5)], dtype, window=window)
    _assert_close(got, want)


@DTYPES
@pytest.mark.parametrize("window", [None, 1, 20, 48])
def test_native_decode(each_level, dtype, window):
    """Decodes straight from the pages: padded tables, a shared prefix, grouped heads, a window, and the
    decodes of a mixed step; never a slot past a context (those hold NaN here)."""
    for seqs in ([(100, 1), (70, 1), (1, 1), (33, 1), (16, 1), (48, 1)], [(90, 23), (70, 1), (40, 40), (16, 1)]):
        got, want, _ = _run(seqs, dtype, share_pages=1, window=window, path="native")
        _assert_close(got, want)


PAGE_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16-pages", "int8-pages"])


@PAGE_DTYPES
@pytest.mark.parametrize("window", [None, 20])
def test_torch_path_reads_pages_of_another_dtype(monkeypatch, kv_dtype, window):
    """float32 queries over bf16 or int8 pages: decodes (the shared prefix read once among them) and prefill chunks
    gather the pages and decode them (kernels/kv_pages.py) as the reference does."""
    monkeypatch.setattr(attention, "SHARED_PREFIX_MIN_SAVED_KEYS", 0)
    for seqs in ([(100, 1), (70, 1), (90, 1), (50, 1)], [(90, 23), (70, 1), (40, 40), (16, 1), (5, 5)]):
        got, want, plan = _run(seqs, torch.float32, share_pages=3, window=window, kv_dtype=kv_dtype)
        _assert_close(got, want)
    assert plan.chunks


@PAGE_DTYPES
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_of_pages_of_another_dtype(each_level, kv_dtype, window):
    """The kernel reads bf16 pages, and int8 pages' codes with their scales (scores dot(q, codes) * scale, values
    weight * scale * codes), straight from the pages; an int8 slot past a context has a NaN scale here."""
    for seqs in ([(100, 1), (70, 1), (1, 1), (33, 1), (16, 1), (48, 1)], [(90, 23), (70, 1), (40, 40), (16, 1)]):
        got, want, _ = _run(seqs, torch.float32, share_pages=1, window=window, path="native", kv_dtype=kv_dtype)
        _assert_close(got, want)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 20), (9, 3, 64), (32, 8, 64), (10, 2, 36), (8, 1, 128)])
def test_native_int8_decode_shapes(each_level, heads, kv_heads, head_dim):
    """int8 rows of head_dim + 4 bytes: heads that are not whole vectors, and the rows' scales, at every width."""
    got, want, _ = _run([(37, 1), (200, 1), (5, 1)], torch.float32, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, path="native", kv_dtype=torch.int8)
    _assert_close(got, want)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 20), (9, 3, 64), (32, 8, 64), (10, 2, 36), (8, 1, 128)])
def test_native_decode_shapes(each_level, heads, kv_heads, head_dim):
    """Head sizes that are not a multiple of the kernel's lanes; one, three, four (a block of them), five and eight
    query heads per KV head."""
    got, want, _ = _run([(37, 1), (200, 1), (5, 1)], torch.float32, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, path="native")
    _assert_close(got, want)


def test_native_decode_is_the_same_on_every_simd_level(kernels):
    """The kernel's sums keep one order and every SIMD level fuses its multiply-adds, so every SIMD level this CPU
    runs gives the same bits (the portable level, which does not fuse them, is checked against torch above)."""
    kernels("portable")
    outputs = {}
    for name in (lv for lv in qmm.runnable() if lv != "portable"):
        qmm.use(name)
        outputs[name], _, _ = _run([(100, 1), (70, 1), (33, 1)], torch.float32, share_pages=2, path="native")
    first = next(iter(outputs.values()))
    assert all(torch.equal(first, out) for out in outputs.values()), list(outputs)


@pytest.mark.parametrize("window", [None, 300])
def test_native_decode_of_long_contexts(each_level, window):
    """Contexts of many pages, a window among them."""
    got, want, _ = _run([(700, 1), (300, 1), (257, 1), (256, 1), (5, 1)], torch.float32, share_pages=2,
                        window=window, path="native")
    _assert_close(got, want)


@pytest.mark.parametrize("window", [0, 300])
def test_native_decode_does_not_depend_on_the_batch(kernels, window):
    """A sequence's result is the same bits alone and beside others, whatever the thread count: sequences side by
    side go through their pages together, in chunks that depend on both, and a chat's tokens must not change with
    the chats decoding beside it."""
    kernels("portable")  # skips where the kernels are not built
    qmm.use(qmm.runnable()[0])  # then the CPU's best level
    seqs = [(600, 1), (50, 1), (900, 1)] + [(330 + 9 * i, 1) for i in range(14)]
    batch = make_batch(seqs, 9, 3, 64, 16, torch.float32, share_pages=20)

    def attend(rows: slice) -> torch.Tensor:
        return qmm.attend(batch.q[rows], batch.k_cache, batch.v_cache, batch.block_tables[rows],
                          batch.context_lens[rows], batch.scale, window)

    alone = torch.cat([attend(slice(i, i + 1)) for i in range(len(seqs))])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            assert torch.equal(attend(slice(None)), alone), f"{n} threads"
    finally:
        torch.set_num_threads(threads)
