"""Quantized weights on torch's int4 kernel, the path where pagedchat's own kernels are not built (tests of those:
test_qmm.py, test_packed_models.py): GGUF blocks -> int4 groups -> torch's packed int4 matmul, checked against
gguf's own dequantization element for element, and tiny models against transformers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_reference import shared_greedy, shared_reference, transformers_from_gguf
from kquants import q4_k_blocks
from parity import NEAR_TIE, NEAR_TIE_BF16, assert_same_greedy
from safetensors.torch import load_file
from tiny_gguf import gguf_name, write_tiny_gguf
from tiny_models import hf_greedy, make_tiny_model

from pagedchat import Engine, SamplingParams
from pagedchat.model import packed_cache, quant
from pagedchat.model.linear import Concat, Linear
from pagedchat.model.gguf import convert_gguf

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not quant.int4_available(), reason="this torch has no CPU int4 kernel")


@pytest.fixture(autouse=True)
def _torch_paths(kernels):
    kernels("off")


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def exact_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of kind for an [n, k] tensor whose scales (and zeros) are exact in bf16, so that the
    kernel's bf16 scales hold the file's numbers and the comparison can be exact. Codes are random bytes."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d = np.ldexp(1.0, -rng.integers(4, 9, raw.shape[:2]))  # powers of two
    raw[..., 0:2] = _f16_bytes(d)
    if kind == "Q4_1":
        raw[..., 2:4] = _f16_bytes(-d * rng.integers(0, 16, raw.shape[:2]))  # m + 8d stays a small multiple of d
    if kind == "Q4_K":
        raw[..., 2:4] = _f16_bytes(d)  # dmin = d: every zero is (8 sc - mn) d
        sc, mn = rng.integers(0, 16, (2, *raw.shape[:2], 8), dtype=np.uint8)  # 4 bits: 8 sc - mn fits bf16
        raw[..., 4:8], raw[..., 8:12] = sc[..., :4], mn[..., :4]
        raw[..., 12:16] = sc[..., 4:] | (mn[..., 4:] << 4)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_packed_weights_unpack_to_ggufs_dequantization(kind):
    """Pack the blocks, read every row back out of the kernel's packed layout: gguf's dequantize, exactly.
    And the packed matmul computes with those numbers (to bf16 output rounding)."""
    n, k = 192, 512
    blocks = exact_blocks(kind, n, k)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, T[kind]).reshape(n, k))
    linear = quant.Int4Linear(quant.int4_groups(blocks, kind, (n, k)))
    assert linear.gathers_rows
    assert torch.equal(linear.rows(torch.arange(n)), want)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.float() @ want.T
    torch.testing.assert_close(linear(x).float(), ref, atol=ref.abs().max().item() / 100, rtol=0)


def test_q8_0_halves_are_exact_on_real_quantizer_output():
    """Q8_0 from gguf's own quantizer: the two 4-bit halves rebuild it exactly (before the bf16 scale)."""
    w = np.random.default_rng(2).standard_normal((64, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, T.Q8_0)
    groups = quant.int4_groups(blocks, "Q8_0", (64, 96))
    got = quant._reconstruct(*(torch.from_numpy(a) for a in (groups.codes, groups.scale, groups.zero)), True)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(blocks, T.Q8_0)))


def _linear_names(folder) -> tuple[str, ...]:
    return tuple(gguf_name(n) for n, t in load_file(folder / "model.safetensors").items() if t.dim() == 2)


def test_q4_k_from_a_quantizer_unpacks_to_ggufs_dequantization():
    """Blocks as a quantizer writes them (6-bit sub-scales and mins up to 63, f16 d and dmin): the groups
    rebuild gguf's dequantization to float32 rounding, and the kernel's bf16 scale and zero move each weight by
    at most bf16's half step of them."""
    w = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32) * 0.05
    blocks = q4_k_blocks(w)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, T.Q4_K).reshape(w.shape))
    assert (want - torch.from_numpy(w)).abs().max() < 0.1 * np.abs(w).max()  # the quantizer quantizes
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks.reshape(-1, 144)[:, 4:16]))
    assert sc.max() == mn.max() == 63  # the 6-bit values' high bits in use (exact_blocks keeps them 0)
    groups = quant.int4_groups(blocks, "Q4_K", w.shape)
    codes, scale, zero = (torch.from_numpy(a) for a in (groups.codes, groups.scale, groups.zero))
    exact = quant._reconstruct(codes, scale, zero, False)  # float32 scale and zero: (q - 8) s + z against q s - m
    torch.testing.assert_close(exact, want, rtol=0, atol=1e-6 * want.abs().max().item())
    bound = 2.0 ** -8 * (8 * scale.abs() + zero.abs())  # |q - 8| <= 8; bf16 moves each by 2^-8 of itself at most
    err = (groups.dequantize() - want).abs().view(*scale.shape, quant.GROUP)
    assert (err <= bound[..., None] * 1.001).all() and err.max() > 0  # not bf16-exact, unlike exact_blocks


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def tiny_quantized(request, tmp_path_factory):
    """A tiny llama (tied) with every matrix in one quantized type, converted; and transformers' model of it."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"tiny-{kind}")
    # Q4_K blocks are 256 wide: the matrices' inputs must be multiples of 256.
    src = make_tiny_model(root / "src", head_dim=64 if kind == "Q4_K" else 16)
    # gguf quantizes the other types; Q4_K is quantized here, the way llama.cpp does.
    path = write_tiny_gguf(src, root / "tiny.gguf", quantized=_linear_names(src), qtype=T[kind],
                           blocks=(lambda name, arr: q4_k_blocks(arr)) if kind == "Q4_K" else None)
    folder = convert_gguf(path, root / "out")
    return kind, folder, transformers_from_gguf(folder)


PROMPTS = [[5, 17, 42, 99, 3, 250, 12], [7, 7, 300, 1, 64, 65, 66, 67, 68, 69, 70]]


def test_quantized_gguf_greedy_matches_transformers(tiny_quantized, monkeypatch, tmp_path):
    """float32: dequantized exactly, the tokens equal transformers' bit for bit. bf16: packed int4, the tokens
    equal transformers' (float32, same GGUF) up to near-ties."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    kind, folder, ref = tiny_quantized
    for dtype, near_tie in (("float32", NEAR_TIE), ("bfloat16", NEAR_TIE_BF16)):
        engine = Engine(str(folder), kv_cache_memory="4MiB", dtype=dtype)
        runs = "float32" if dtype == "float32" else ("2×int4" if kind == "Q8_0" else "int4")
        assert engine.model.weight_precision == f"{kind} as {runs}"
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
        engine.shutdown()
        for prompt, out in zip(PROMPTS, outs):
            assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 12), near_tie=near_tie)


def test_packed_weight_bytes_are_the_packed_tensors(tiny_quantized, monkeypatch, tmp_path):
    """weight_bytes counts what is resident: 4-bit codes, bf16 scale/zero pairs and norms, the tied table once
    (read from the head's packed codes); the whole is near the GGUF's own tensor bytes."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    kind, folder, _ = tiny_quantized
    engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    cfg, model = engine.config, engine.model
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = [(cfg.num_heads * d + 2 * cfg.num_kv_heads * d, h), (h, cfg.num_heads * d), (2 * inter, h), (h, inter)]
    width = 2 if kind == "Q8_0" else 1  # Q8_0's two halves
    packed = lambda n, k: n * k * width // 2 + (k * width // 32) * n * 2 * 2  # noqa: E731 - codes + (scale, zero)
    layers = cfg.num_layers * (sum(packed(n, k) for n, k in per_layer) + 2 * h * 2)
    expected = layers + packed(cfg.vocab_size, h) + h * 2
    assert model.weight_bytes() == expected
    assert model.embed is model.lm_head
    reader = gguf.GGUFReader(engine.model_path / ".." / "tiny.gguf")
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert model.weight_bytes() <= 1.2 * file_bytes
    engine.shutdown()


def test_packed_cache_restores_the_same_model(tiny_quantized, monkeypatch, tmp_path):
    """A second load maps the saved packed tensors (the GGUF is not read) and computes the same logits; a
    damaged cache file is rebuilt."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    kind, folder, _ = tiny_quantized
    first = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    want = first.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    first.shutdown()
    [entry] = (tmp_path / "packed").iterdir()

    from pagedchat.engine import engine as engine_module

    def no_reading(*args):
        raise AssertionError("read the GGUF although a packed cache exists")

    monkeypatch.setattr(engine_module, "load_weights", no_reading)
    second = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    got = second.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert second.model.weight_precision == first.model.weight_precision
    assert second.model.weight_bytes() == first.model.weight_bytes()
    second.shutdown()

    monkeypatch.undo()
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    entry.write_bytes(entry.read_bytes()[:100])
    third = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    assert [o.token_ids for o in third.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))] == \
        [o.token_ids for o in want]
    third.shutdown()
    assert packed_cache.read(entry) is not None  # rewritten whole

    from safetensors import safe_open
    from safetensors.torch import load_file as load_entry, save_file

    with safe_open(entry, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_entry(entry)
    tensors.pop(next(k for k in tensors if k.endswith(".packed")))  # readable, but lacking a tensor
    save_file(tensors, entry, metadata=metadata)
    fourth = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    assert fourth.model.weight_bytes() == first.model.weight_bytes()
    fourth.shutdown()


def test_float32_keeps_no_cache(tiny_quantized, monkeypatch, tmp_path):
    """float32 weights are never written to disk: only packed weights are cached."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    _, folder, _ = tiny_quantized
    Engine(str(folder), kv_cache_memory="4MiB", dtype="float32").shutdown()
    assert not (tmp_path / "packed").exists()


@pytest.mark.parametrize("quantize,kind", [("int4", "Q4_1"), ("int8", "Q8_0")])
def test_quantize_a_safetensors_model(tmp_path, monkeypatch, quantize, kind):
    """--quantize packs a float model group-wise (gguf's quantizer): its tokens are those of transformers on
    the quantized-then-dequantized weights, up to near-ties. Without it nothing changes."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    src = make_tiny_model(tmp_path / "src", seed=3)
    plain = Engine(str(src), kv_cache_memory="4MiB", dtype="bfloat16")
    assert plain.model.weight_precision == "bfloat16"
    plain.shutdown()
    engine = Engine(str(src), kv_cache_memory="4MiB", dtype="bfloat16", quantize=quantize)
    runs = "2×int4" if quantize == "int8" else "int4"
    assert engine.model.weight_precision == f"{runs} (quantized at load)"
    assert engine.model.weight_bytes() < plain.model.weight_bytes()
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    engine.shutdown()

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:  # what the engine packs, as it packs it: from the bf16 weights
                q = gguf.quants.quantize(p.bfloat16().float().numpy(), T[kind])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, T[kind])))
    for prompt, out in zip(PROMPTS, outs):
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 10), near_tie=NEAR_TIE_BF16)


def test_mixed_types_as_in_a_q4_k_m_file(tmp_path, monkeypatch):
    """Files mix types within a layer (Q4_K_M keeps attn_v and ffn_down in Q6_K): q and k stay one packed
    matmul beside v dequantized to bf16, and the tokens still match transformers up to near-ties."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    src = make_tiny_model(tmp_path / "src", tie=False, seed=5)
    types = {"attn_v": T.Q5_0, "ffn_down": T.Q5_0, "token_embd": T.Q8_0, "*": T.Q4_0}
    folder = convert_gguf(write_tiny_gguf(src, tmp_path / "mixed.gguf", quantized=_linear_names(src), qtype=types),
                          tmp_path / "out")
    ref = transformers_from_gguf(folder)
    engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    model = engine.model
    assert model.weight_precision == "Q4_0 as int4 + Q5_0 as bfloat16 + Q8_0 as 2×int4"
    assert isinstance(model.layers[0].qkv, Concat) and isinstance(model.layers[0].down, Linear)
    assert isinstance(model.embed, quant.Int4Linear) and model.embed is not model.lm_head  # untied, packed
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 12), near_tie=NEAR_TIE_BF16)


def test_unknown_quantize_is_one_line():
    with pytest.raises(ValueError, match="unknown quantization 'int3': use int4, int8 or none"):
        from pagedchat.engine.sizing import parse_quantize

        parse_quantize("int3")


# Packed weights at prefill sizes: from quant.DENSE_MIN_ROWS rows a projection dequantizes its packed weight into
# reused float32 scratch and runs a dense GEMM. It must compute what the int4 kernel computes.
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("bias,scratch", [(False, 1 << 21), (True, 1)])
def test_dense_path_computes_what_the_kernel_does(kind, bias, scratch, monkeypatch):
    """Same weights, same input: the dense path's outputs equal the kernel's up to the bf16 rounding of a
    different summation order, and are as close to float32 arithmetic on gguf's dequantized weight; also when
    the scratch holds one packed tile at a time."""
    monkeypatch.setattr(quant, "DENSE_SCRATCH_WEIGHTS", scratch)
    n, k, rows = 192, 512, 40
    groups = quant.int4_groups(exact_blocks(kind, n, k), kind, (n, k))
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    linear = quant.Int4Linear(groups, b)
    assert linear.gathers_rows  # out features in whole packed tiles: the dense path applies
    x = torch.randn(rows, k, generator=gen).bfloat16()
    monkeypatch.setattr(quant, "DENSE_MIN_ROWS", rows + 1)
    kernel = linear(x)
    monkeypatch.setattr(quant, "DENSE_MIN_ROWS", rows)
    dense = linear(x)
    weight = gguf.quants.dequantize(exact_blocks(kind, n, k), T[kind]).reshape(n, k)
    want = x.float() @ torch.from_numpy(weight).float().T + (b.float() if bias else 0)
    kernel_error = (kernel.float() - want).abs().max()
    assert kernel_error < 0.05 * want.abs().max()  # the reference is right: only bf16 roundings apart
    assert (dense.float() - want).abs().max() <= 1.5 * kernel_error
    assert (dense != kernel).float().mean() < 0.01  # a few roundings part, not a different product


@pytest.mark.slow
def test_default_model_dense_prefill_matches_transformers(default_model, monkeypatch):
    """The default model with every prefill chunk on the dense path: transformers' tokens up to near-ties."""
    monkeypatch.setattr(quant, "DENSE_MIN_ROWS", 8)
    engine = Engine(str(default_model), kv_cache_memory="128MiB", dtype="bfloat16")
    ref = shared_reference(default_model, torch.bfloat16)
    chats = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
             [{"role": "system", "content": "You are a terse assistant."},
              {"role": "user", "content": "Name three uses of a paperclip."}]]
    prompts = [engine.encode_prompt(chat) for chat in chats]
    assert min(len(p) for p in prompts) >= 8
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    engine.shutdown()
    for prompt, out in zip(prompts, outs):
        expected = shared_greedy(default_model, torch.bfloat16, prompt, 16, sorted(engine.eos_token_ids))
        assert_same_greedy(ref, prompt, out.token_ids, expected, near_tie=NEAR_TIE_BF16)
