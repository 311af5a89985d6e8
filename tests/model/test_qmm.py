"""pagedchat's quantized kernels (pagedchat/model/csrc, loaded by qmm.py): every type of a typical GGUF, on every
instruction-set level this CPU runs, against gguf's own dequantization times the same int8 activations."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from kquants import quantize

from pagedchat.model import qmm
from pagedchat.model.blocks import BlockLinear, Blocks

T = gguf.GGMLQuantizationType
KINDS = list(qmm.TYPES)
LEVELS = [lv.name for lv in qmm.levels_to_build()]


@pytest.fixture
def level(request, kernels):
    """The level named by the test's parameter in use, for this test only."""
    kernels(request.param)
    return request.param


def quantized(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """A [n, k] weight quantized the way llama.cpp does (gguf's quantizer, or kquants' for the K types)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return quantize(w, kind)


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Every bit of every block random (the high bits of Q4_K's 6-bit scales and Q6_K's negative scales
    included), then the f16 scales set to small finite values: the decoding's every path, whatever a quantizer
    tends to write."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    f16 = lambda lo, hi: rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)  # noqa: E731
    where = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
             "Q6_K": [208]}[kind]
    for offset in where:
        raw[..., offset:offset + 2] = f16(-0.02, 0.02)
    return raw.reshape(n, -1)


def widths(kind: str) -> tuple[int, ...]:
    """Input widths: for the 32-wide types an odd block count too (the 512-bit loop's half-width tail)."""
    return (96, 576) if gguf.GGML_QUANT_SIZES[T[kind]][0] == 32 else (256, 768)


def quantize_activations(x: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations, computed here in numpy: per group inputs (32, or 256: qmm.activation_group) d =
    max |x| / 127 and q = x / d rounded half away from zero (as ggml rounds), both in float32. Returns q [m, k] and
    each block of 32's d, [m, k / 32]."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, group)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float32)
    q = np.trunc(v + np.where(v < 0, np.float32(-0.5), np.float32(0.5))).astype(np.float32)
    return torch.from_numpy(q.reshape(x.shape)).double(), torch.from_numpy(d.repeat(group // 32, -1)).double()


def reference(x: torch.Tensor, blocks: np.ndarray, kind: str,
              group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ W.T in float64 on the same int8 activations: sum over blocks of d * (q . w), W gguf's dequantization.
    Also the sum of the terms' magnitudes, the scale of float32's summation error. group: the activations' (by
    default the one this kind's matmul alone takes)."""
    n = blocks.shape[0]
    w = torch.from_numpy(gguf.quants.dequantize(blocks, T[kind]).reshape(n, -1)).double()
    q, d = quantize_activations(x, group or qmm.activation_group([kind], x.shape[1]))
    terms = (q.view(q.shape[0], 1, -1, 32) * w.view(1, n, -1, 32)).sum(-1) * d[:, None, :]  # [m, n, blocks]
    return terms.sum(-1), (q.abs().view(q.shape[0], 1, -1, 32) * w.abs().view(1, n, -1, 32)).sum(-1).mul(
        d[:, None, :]).sum(-1)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [quantized, random_blocks], ids=["quantizer", "random-bits"])
def test_matmul_is_ggufs_weights_times_the_int8_activations(level, kind, make):
    """For 1 row (one chat's decode) through 8, 16 and a ragged 37 (a batch, and the tiles' remainders), on 43
    weight rows (panels of 8 and a remainder): the kernel's float32 sums of the same products, to float32
    rounding; and within int8's error of the float product itself."""
    for k in widths(kind):
        n = 43
        blocks = make(kind, n, k, seed=k)
        linear = BlockLinear.of(Blocks(blocks, kind))
        for rows in (1, 8, 16, 37):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            want, scale = reference(x, blocks, kind)
            got = linear(x).double()
            assert ((got - want).abs() <= 1e-5 * scale + 1e-30).all(), f"k={k} rows={rows}"
            w = torch.from_numpy(gguf.quants.dequantize(blocks, T[kind]).reshape(n, -1)).double()
            exact = x.double() @ w.T
            assert (got - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", ["wide", "spans"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(level, kind, k):
    """Bit for bit, a row alone and the same row among 2, 4, 5, 8, 16, 20 or 37: a chat's tokens must not change
    with the number of chats decoding beside it. Up to four rows take an AVX2 panel's two lane groups in one pass,
    five and more a pass each. One tile of rows decodes a panel's codes as it goes, more than one decode them once
    into a buffer, a span of 32 blocks at a time: "spans" is an input of one and a half spans. Rows are split evenly
    between tiles, so 20 and 37 rows take tiles of heights no other count here does."""
    k = widths(kind)[-1] if k == "wide" else 1536
    linear = BlockLinear.of(Blocks(random_blocks(kind, 43, k, seed=1), kind))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([linear(x[i:i + 1]) for i in range(37)])
    for rows in (2, 4, 5, 8, 16, 20, 37):
        assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_amx_gives_the_avx512_vnni_levels_bits_at_every_row_count(kind, kernels):
    """The amx level's tiles take over the integer unit dots only, exact in int32, and its float sums after them
    are the VNNI level's in the same order: the same bits for every row count from 1 to 40 (the VNNI tiles below
    16 rows, one AMX tile of 16 and more, with a ragged last one, above), over one and a half spans of blocks."""
    k = 1536
    linear = BlockLinear.of(Blocks(random_blocks(kind, 43, k, seed=2), kind))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3))
    kernels("avx512-vnni")
    want = [linear(x[:rows]) for rows in range(1, 41)]
    kernels("amx")
    for rows in range(1, 41):
        assert torch.equal(linear(x[:rows]), want[rows - 1]), f"{rows} rows"


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_weights_of_several_types_side_by_side_are_each_ones_matmul(level):
    """matmul_cat quantizes the activations once for every weight: each output bit for bit its weight's matmul
    alone, where that weight alone takes the same activation group (q and k beside a v of another type, as a
    Q4_K_M file has them; K types only, which the AVX2 level quantizes per 256, and K types beside others, which
    every level quantizes per 32). Where it does not, the output is still its weight times the call's activations."""
    for kinds in (["Q5_0", "Q8_0", "Q4_K", "Q6_K"], ["Q4_K", "Q6_K", "Q5_K"]):
        blocks = [random_blocks(kind, n, 512, seed=n) for kind, n in zip(kinds, (48, 16, 32, 19))]
        weights = [qmm.pack(torch.from_numpy(b), kind) for b, kind in zip(blocks, kinds)]
        group = qmm.activation_group(kinds, 512)
        assert group == (256 if level == "avx2" and len(kinds) == 3 else 32)
        for rows in (1, 9):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            together = qmm.matmul_cat(x, weights, kinds).split([w.shape[0] for w in weights], dim=1)
            for part, b, w, kind in zip(together, blocks, weights, kinds):
                if qmm.activation_group([kind], 512) == group:
                    assert torch.equal(part, qmm.matmul(x, w, kind)), kind
                else:
                    want, scale = reference(x, b, kind, group)
                    assert ((part.double() - want).abs() <= 1e-5 * scale + 1e-30).all(), kind


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_ggufs_bit_for_bit(level, kind):
    """The rows an embedding lookup and the prefill path read: gguf's own dequantization, exactly."""
    for make in (quantized, random_blocks):
        blocks = make(kind, 24, widths(kind)[-1], seed=7)
        want = torch.from_numpy(gguf.quants.dequantize(blocks, T[kind]).reshape(24, -1).astype(np.float32))
        linear = BlockLinear.of(Blocks(blocks, kind))
        assert torch.equal(qmm.dequantize(torch.from_numpy(blocks), kind), want)
        ids = torch.tensor([5, 0, 23, 5])
        assert torch.equal(linear.rows(ids), want[ids])


@pytest.mark.parametrize("kind", KINDS)
def test_packing_reorders_the_files_bytes_and_loses_none(kind):
    """The kernels' layout holds the file's bytes at the file's size: every row comes back as the file wrote it,
    from the panels and from the rows after the last whole panel, which alone keep the file's order."""
    if qmm.ensure() is not None:
        pytest.skip(qmm.ensure())
    blocks = torch.from_numpy(random_blocks(kind, 43, widths(kind)[-1], seed=2))
    packed = qmm.pack(blocks, kind)
    assert packed.shape == blocks.shape
    ids = torch.arange(43).flip(0)
    assert torch.equal(qmm.unpack(packed, kind, ids), blocks[ids])
    assert torch.equal(packed[32:], blocks[32:])
    assert not torch.equal(packed[:32], blocks[:32])


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_bf16_activations_and_a_bias(level):
    """bf16 in, bf16 out (the dtype a native-bf16 CPU runs in), the bias added after."""
    blocks = quantized("Q4_1", 64, 256, seed=1)
    bias = torch.randn(64)
    linear = BlockLinear.of(Blocks(blocks, "Q4_1"), bias.bfloat16())
    x = torch.randn(3, 256).bfloat16()
    y = linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
    want, _ = reference(x.float(), blocks, "Q4_1")
    torch.testing.assert_close(y.float(), (want.float() + bias.bfloat16().float()).bfloat16().float(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_a_prompts_rows_take_the_integer_kernels_on_every_level(kind, each_level):
    """A prompt's chunk of hundreds of rows runs the level's integer dot products, the portable level's too: the
    same bits, row for row, as the same rows in a step of their own (a decode's)."""
    raw = quantized(kind, 48, 512, seed=3)
    linear = BlockLinear.of(Blocks(raw, kind))
    x = torch.randn(300, 512)
    w = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).reshape(48, -1).astype(np.float32))
    y = linear(x)
    assert torch.equal(y, qmm.matmul(x, linear.panels, kind))
    assert torch.equal(y[:3], linear(x[:3]))
    assert torch.equal(y[-1:], linear(x[-1:]))
    torch.testing.assert_close(y, x @ w.T, rtol=0.05, atol=0.3)


def test_blocks_from_a_float_weight_are_ggufs_quantizer():
    """--quantize on a safetensors model: gguf's own quantizer, rows kept as rows."""
    w = torch.randn(32, 64)
    b = Blocks.quantize(w, "Q8_0")
    assert b.kind == "Q8_0" and b.data.shape == (32, 2 * 34)
    assert np.array_equal(b.data, gguf.quants.quantize(w.numpy(), T.Q8_0))


def test_a_forced_level_the_cpu_lacks_says_so(monkeypatch):
    if qmm.ensure() is not None:
        pytest.skip(qmm.ensure())
    monkeypatch.setenv(qmm.ENV, "sse9")
    try:
        why = qmm.ensure()
        assert why.startswith(f"{qmm.ENV}=sse9: not a level this CPU runs (it runs {qmm.runnable()[0]}")
        assert not qmm.ready() and qmm.short() == "torch"
        monkeypatch.setenv(qmm.ENV, "off")
        assert qmm.ensure() == f"off: {qmm.ENV}=off"
        assert qmm.describe() == f"torch's kernels (off: {qmm.ENV}=off)"
    finally:
        monkeypatch.undo()
        qmm.ensure()
    assert qmm.ready() and qmm.level().name == qmm.runnable()[0]


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_auto_is_the_cpus_best_level_as_unset_is(value, monkeypatch):
    if qmm.ensure() is not None:
        pytest.skip(qmm.ensure())
    monkeypatch.setenv(qmm.ENV, value)
    try:
        assert qmm.ensure() is None
        assert qmm.ready() and qmm.level().name == qmm.runnable()[0]
        assert "forced" not in qmm.describe()
    finally:
        monkeypatch.undo()
        qmm.ensure()


@pytest.mark.slow  # compiles the library a second time (the session's build tests the sources)
def test_a_library_built_for_lower_levels_runs_only_those(tmp_path):
    """Built with the portable level only (what a build for an older machine holds, and the quickest to
    compile), the library offers just that, whatever this CPU has: in a fresh process, since a library cannot
    be unloaded."""
    if qmm.unavailable() is not None:
        pytest.skip(qmm.unavailable())
    wanted = tuple(lv for lv in qmm.levels_to_build() if lv.name == "portable")
    target = tmp_path / "qmm-low.so"
    built = qmm.build(target, only=wanted)
    assert built == ["portable"]
    code = f"import torch; torch.ops.load_library({str(target)!r}); print(list(torch.ops.pagedchat_qmm.levels()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(["portable"])


def test_no_compiler_leaves_torchs_paths_with_the_reason(monkeypatch, caplog):
    """Said once in the log, however many engines start; and in describe(), which pull and the bench print."""
    monkeypatch.setattr(qmm, "_state", qmm.State())
    monkeypatch.setattr(qmm, "compiler", lambda: None)
    with caplog.at_level("WARNING", logger=qmm.__name__):
        assert qmm.ensure() == qmm.ensure() == "no C++ compiler (c++ or $CXX) on PATH"
    assert [r.getMessage() for r in caplog.records] == [
        "pagedchat's quantized kernels are not used, torch's paths serve: no C++ compiler (c++ or $CXX) on PATH"]
    assert not qmm.ready() and qmm.describe() == "torch's kernels (no C++ compiler (c++ or $CXX) on PATH)"


@pytest.mark.slow  # compiles every level's sources to see one fail: the no-compiler case falls back
def test_a_failed_build_is_remembered(monkeypatch, tmp_path):
    """A source that does not compile: torch's paths, the compiler's message beside the library's name, and no
    second attempt at the next start."""
    if qmm.unavailable() is not None:
        pytest.skip(qmm.unavailable())
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "qmm_level.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(qmm, "LEVEL_SOURCES", (broken, *qmm.LEVEL_SOURCES[1:]))
    monkeypatch.setattr(qmm, "_state", qmm.State())
    marker = qmm.failure_path(qmm.library_path())
    assert qmm.ensure() == f"compiling pagedchat's kernels failed (see {marker})"
    assert "this is not C++" in marker.read_text() or "error" in marker.read_text()
    assert not qmm.library_path().exists()
    monkeypatch.setattr(qmm, "_state", qmm.State())
    monkeypatch.setattr(qmm, "build", lambda *a, **k: pytest.fail("built again"))
    assert qmm.ensure() == f"they did not compile here (see {marker})"
