"""Models whose GGUF weights run from the file's own blocks on pagedchat's kernels, the CPU's default path: every
type of a typical download, on every level this CPU runs, against transformers on the same GGUF (float32, its
weights dequantized) up to near-ties; a Q4_K_M-shaped file with every tensor packed; the weights at the file's
size; the packed-weights cache; `--quantize`."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_reference import transformers_from_gguf
from kquants import quantize
from parity import NEAR_TIE_BF16, NEAR_TIE_PACKED, assert_same_greedy
from safetensors.torch import load_file
from tiny_gguf import gguf_name, write_tiny_gguf
from tiny_models import hf_greedy, make_tiny_model

from pagedchat import Engine, SamplingParams
from pagedchat.engine import sizing
from pagedchat.model import qmm, quant
from pagedchat.model.blocks import BlockLinear
from pagedchat.model.gguf import convert_gguf
from pagedchat.model.linear import Concat

T = gguf.GGMLQuantizationType
LEVELS = [lv.name for lv in qmm.levels_to_build()]
PROMPTS = [[5, 17, 42, 99, 3, 250, 12], [7, 7, 300, 1, 64, 65, 66, 67, 68, 69, 70]]
TOKENS = 12


def linear_names(folder) -> tuple[str, ...]:
    return tuple(gguf_name(n) for n, t in load_file(folder / "model.safetensors").items() if t.dim() == 2)


def tiny_gguf_model(root, types, *, tie: bool = True, seed: int = 0):
    """A tiny llama (256 wide: whole K-quant super-blocks) written as a GGUF with its matrices quantized the way
    llama.cpp does (types: one type, or {"attn_v": type, "*": type}), converted; transformers' model of it and
    its greedy tokens on PROMPTS."""
    src = make_tiny_model(root / "src", head_dim=64, tie=tie, seed=seed)

    def kind_of(name: str) -> str:
        return types if isinstance(types, str) else types.get(name.split(".")[-2], types["*"])

    qtype = T[types] if isinstance(types, str) else {k: T[v] for k, v in types.items()}
    path = write_tiny_gguf(src, root / "tiny.gguf", quantized=linear_names(src), qtype=qtype,
                           blocks=lambda name, arr: quantize(arr, kind_of(name)))
    folder = convert_gguf(path, root / "out")
    ref = transformers_from_gguf(folder)
    return folder, path, ref, [hf_greedy(ref, p, TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module", params=list(qmm.TYPES))
def tiny_of_type(request, tmp_path_factory):
    kind = request.param
    return (kind, *tiny_gguf_model(tmp_path_factory.mktemp(f"tiny-{kind}"), kind))


def generate(folder, **engine_kwargs):
    engine = Engine(str(folder), kv_cache_memory="4MiB", **engine_kwargs)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    return engine, outs


@pytest.mark.parametrize("level", LEVELS)
def test_every_type_on_every_level_matches_transformers(tiny_of_type, level, kernels, monkeypatch, tmp_path):
    """float32 activations (what a CPU without native bf16 runs): the file's blocks, no float copy, and
    transformers' tokens up to the near-ties that int8 activations may flip."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    kernels(level)
    kind, folder, _, ref, expected = tiny_of_type
    engine, outs = generate(folder, dtype="float32")
    label = next(lv.label for lv in qmm.levels_to_build() if lv.name == level)
    assert engine.model.weight_precision == f"{kind} packed · {label}"
    assert isinstance(engine.model.layers[0].qkv, BlockLinear) and engine.model.embed is engine.model.lm_head
    engine.shutdown()
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert_same_greedy(ref, prompt, out.token_ids, want, near_tie=NEAR_TIE_PACKED)


@pytest.fixture(scope="module")
def tiny_q4_0(tmp_path_factory):
    return tiny_gguf_model(tmp_path_factory.mktemp("tiny-pages"), "Q4_0")


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
@pytest.mark.parametrize("level", LEVELS)
def test_pages_of_every_dtype_under_the_fused_float32_step(tiny_q4_0, kv, level, kernels, monkeypatch, tmp_path):
    """float32 activations on packed weights write the pages in the rotary kernel and read them in the decode
    kernel (one fused call a layer): bf16 and int8 pages there too, on every level; transformers' tokens up to the
    packed weights' near-ties."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    kernels(level)
    folder, _, ref, expected = tiny_q4_0
    engine, outs = generate(folder, dtype="float32", kv_cache_dtype=kv)
    assert engine.model.native_steps and engine.runner.kv_cache.dtype == getattr(torch, kv)
    engine.shutdown()
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert_same_greedy(ref, prompt, out.token_ids, want, near_tie=NEAR_TIE_PACKED)


def test_bf16_activations_on_packed_weights(tiny_of_type, monkeypatch, tmp_path):
    """bf16 (a CPU with native bf16: half the KV cache): every type on the blocks where pagedchat's kernels are
    built (faster there than torch's int4 kernel, docs/bench.md#one-kernel-library), else the types torch's int4
    layout holds on that kernel; transformers' tokens up to bf16's near-ties."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    kind, folder, _, ref, expected = tiny_of_type
    engine, outs = generate(folder, dtype="bfloat16")
    if qmm.ensure() is None:
        assert engine.model.weight_precision.startswith(f"{kind} packed · ")
    elif kind in quant.INT4_TYPES and quant.int4_available():
        assert engine.model.weight_precision == f"{kind} as {'2×int4' if kind == 'Q8_0' else 'int4'}"
    engine.shutdown()
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert_same_greedy(ref, prompt, out.token_ids, want, near_tie=NEAR_TIE_BF16)


def test_the_weights_are_the_files_bytes(tiny_of_type, monkeypatch, tmp_path):
    """Resident weights in float32 are exactly the GGUF's tensor bytes: the blocks as stored, the norms in
    float32 as stored, the tied table read from the head's blocks."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    _, folder, path, _, _ = tiny_of_type
    engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="float32")
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert engine.model.weight_bytes() == file_bytes
    engine.shutdown()


def test_the_packed_cache_restores_the_blocks(tiny_of_type, monkeypatch, tmp_path):
    """A start that cannot write the cache runs the model it built; one that can reads its entry back (into huge
    pages); a second start reads the saved blocks instead of the GGUF: the same tokens all three."""
    (tmp_path / "file").write_text("a file where the cache's folder would be: nothing can be written")
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    _, folder, _, _, _ = tiny_of_type
    unsaved, want = generate(folder, dtype="float32")
    unsaved.shutdown()
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    first, got = generate(folder, dtype="float32")
    first.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert first.model.weight_precision == unsaved.model.weight_precision
    from pagedchat.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "load_weights", lambda *a: pytest.fail("read the GGUF despite a cache"))
    second, got = generate(folder, dtype="float32")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert second.model.weight_precision == first.model.weight_precision
    assert second.model.weight_bytes() == first.model.weight_bytes()
    second.shutdown()


# What llama.cpp's quantizer makes of the default model at Q4_K_M: its 576-wide rows fall back from the K types
# to Q5_0, the 1536-wide ones keep Q4_K and Q6_K, the tables Q8_0 (here an untied head in Q6_K, as Q4_K_M keeps).
Q4_K_M = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K", "*": "Q4_K"}


def test_a_q4_k_m_file_runs_every_tensor_packed(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    folder, path, ref, expected = tiny_gguf_model(tmp_path, Q4_K_M, tie=False, seed=5)
    engine, outs = generate(folder, dtype="float32")
    model = engine.model
    for layer in model.layers:
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
            parts = p.parts if isinstance(p, Concat) else [p]
            assert all(isinstance(part, BlockLinear) for part in parts)
    assert isinstance(model.lm_head, BlockLinear) and isinstance(model.embed, BlockLinear)
    assert "as float32" not in model.weight_precision
    assert set(model.precision.replace(" packed", "").split(" + ")) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert isinstance(model.layers[0].gate_up, Concat)  # Q5_0 beside Q4_K: two matmuls, side by side
    # One line per kernel, counting its projections: every GGUF type on pagedchat's kernels, none dense.
    paths = model.run_paths()
    kinds = {line.split(" × ")[1].split(" ")[0]: int(line.split(" × ")[0]) for line in paths.projections}
    assert set(kinds) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert all(qmm.describe() in line for line in paths.projections)
    assert kinds["Q6_K"] == len(model.layers) + 1   # every ffn_down, and the head
    assert "as one call each" in paths.layers and paths.attention
    assert model.weight_bytes() == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    engine.shutdown()
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert_same_greedy(ref, prompt, out.token_ids, want, near_tie=NEAR_TIE_PACKED)
    # bf16 (a CPU with native bf16): still nothing expanded, whichever packed form each type takes there
    engine, outs = generate(folder, dtype="bfloat16")
    assert "as bfloat16" not in engine.model.weight_precision
    assert engine.model.weight_bytes() <= 1.2 * sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    engine.shutdown()
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert_same_greedy(ref, prompt, out.token_ids, want, near_tie=NEAR_TIE_BF16)


@pytest.mark.parametrize("level", LEVELS)
def test_a_decode_layer_in_one_call_is_its_ops_one_by_one(level, kernels, tmp_path, monkeypatch):
    """A float32 decode step runs each layer as one call (qmm.decode_layer): the tokens and their log-
    probabilities bit for bit those of the per-op path, on a Q4_K_M-shaped model (v beside q and k, up beside
    gate, of other types), several chats decoding together."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    kernels(level)
    folder, *_ = tiny_gguf_model(tmp_path, Q4_K_M, tie=False, seed=5)
    runs = []
    for fused in (True, False):
        engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="float32")
        assert all(f is not None for f in engine.model.fused)
        if not fused:
            engine.model.fused = [None] * len(engine.model.fused)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0))
        engine.shutdown()
        runs.append([(o.token_ids, [s.logprob for s in o.logprobs]) for o in outs])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("quantize_as,kind", [("int4", "Q4_1"), ("int8", "Q8_0")])
def test_quantize_a_safetensors_model(tmp_path, monkeypatch, quantize_as, kind):
    """--quantize: gguf's quantizer makes blocks of the float weights, which then run like a GGUF's: the tokens
    of transformers on the quantized-then-dequantized weights, up to near-ties."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    src = make_tiny_model(tmp_path / "src", seed=3)
    engine = Engine(str(src), kv_cache_memory="4MiB", dtype="float32", quantize=quantize_as)
    assert engine.model.weight_precision == f"{kind} packed (quantized at load) · {qmm.short()}"
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    engine.shutdown()
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, p in ref.named_parameters():
            if p.dim() == 2:
                q = gguf.quants.quantize(p.numpy(), T[kind])
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, T[kind])))
    for prompt, out in zip(PROMPTS, outs):
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 10), near_tie=NEAR_TIE_PACKED)


def test_auto_dtype_without_the_kernels(monkeypatch, _float32_by_default):
    """Where the kernels are not built, a quantized model on a CPU without native bf16 runs packed on torch's
    int4 kernel in bf16, which decodes faster than weights expanded to float32; a dense model stays float32.
    With the kernels, float32 activations on the packed blocks, also where the CPU has native bf16 (a dense
    model takes bf16 there)."""
    cpu = torch.device("cpu")
    if qmm.ensure() is not None:
        pytest.skip(qmm.ensure())
    assert sizing.parse_dtype("auto", cpu, quantized=True) == torch.float32
    monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda: True)
    assert sizing.parse_dtype("auto", cpu, quantized=True) == torch.float32
    assert sizing.parse_dtype("auto", cpu, quantized=False) == torch.bfloat16
    monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(qmm, "_state", qmm.State())
    monkeypatch.setattr(qmm, "compiler", lambda: None)
    assert sizing.parse_dtype("auto", cpu, quantized=True) == (torch.bfloat16 if quant.int4_available() else
                                                               torch.float32)
    assert sizing.parse_dtype("auto", cpu, quantized=False) == torch.float32
    assert sizing.parse_dtype("float32", cpu, quantized=True) == torch.float32  # a named dtype is never changed
