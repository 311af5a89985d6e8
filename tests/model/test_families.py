"""Every registered family against transformers: tiny random models from transformers' own configs, greedy
tokens equal in float32 alone, batched, and at 8 chats sharing a system prompt under preemption; each rope kind
against transformers' own rope functions."""

from __future__ import annotations

import re

import gguf
import pytest
import torch
from kquants import quantize
from parity import NEAR_TIE, NEAR_TIE_PACKED, assert_same_greedy
from slow_cases import slow_after
from safetensors.torch import load_file
from tiny_gguf import gguf_name, write_tiny_gguf
from transformers import AutoTokenizer, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedchat import Engine, SamplingParams
from pagedchat.bench.capacity import parameter_count
from pagedchat.errors import ModelError
from pagedchat.model import families
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.gguf import convert_gguf
from pagedchat.model.loader import load_tokenizer, load_weights
from pagedchat.model.family import Rope, base_rope
from pagedchat.model.decoder import rms_norm_unit_offset
from tiny_models import config_of, hf_greedy, load_reference, make_tiny_model

NO_EOS = [10**9]
WINDOW = 24  # shorter than every conversation below but the first, so windows are crossed by several pages

FAMILIES = {
    "qwen3-untied": dict(arch="qwen3", tie=False),
    "qwen3-tied-mqa": dict(arch="qwen3", tie=True, kv_heads=1),
    "smollm3-nope-every-4th": dict(arch="smollm3", layers=4),
    "mistral-window": dict(arch="mistral", window=WINDOW, tie=False),
    "gemma3-local-global": dict(arch="gemma3", layers=6, window=WINDOW),
    "phi3-longrope-partial": dict(arch="phi3", tie=False, window=WINDOW),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param])
    return folder, load_reference(folder)


def prompt_of(tokenizer, n: int, salt: int = 0) -> list[int]:
    text = " ".join(f"fox {salt} jumps over dog {i}, paged blocks hold keys." for i in range(n))
    return tokenizer.encode(text)[:n]


def test_every_family_is_registered_once():
    archs = [f.architecture for f in families.FAMILIES]
    assert len(set(archs)) == len(archs)
    assert {"Qwen3ForCausalLM", "SmolLM3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM",
            "Phi3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"} <= set(archs)


def test_parameter_count_follows_the_recipe(family_model):
    folder, ref = family_model
    assert parameter_count(ModelConfig.from_folder(folder)) == sum(p.numel() for p in ref.parameters())


def test_greedy_matches_transformers(family_model):
    folder, ref = family_model
    engine = Engine(str(folder), kv_cache_memory="4MiB")
    prompts = [prompt_of(engine.tokenizer, n, salt=n) for n in (1, 15, 17, 40, 90)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=37, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 37
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 37, NO_EOS))
    engine.shutdown()


def test_eight_chats_on_one_system_prompt_with_preemption(family_model):
    """8 chats share a system prompt's pages in a pool too small for all of them: some are preempted, and every
    reply still equals transformers' run of that chat alone."""
    folder, ref = family_model
    cfg = ModelConfig.from_folder(folder)
    page = cfg.kv_bytes_per_token(4) * 16
    # Too small for chats that keep every page. Sliding-window layers that release theirs need fewer: that pool
    # and its preemptions are tests/engine/test_window_pages.py's.
    engine = Engine(str(folder), kv_cache_memory=14 * page, swap_space=4 * page, autostart=False,
                    release_windows=False)
    tok = engine.tokenizer
    system = tok.decode(prompt_of(tok, 40))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}: what is {i}?"}]
             for i in range(8)]
    handles = engine.submit_many(chats, SamplingParams(max_tokens=20, ignore_eos=True))
    prompts = [h.prompt_token_ids for h in handles]  # as the family's template quirks render them
    while engine.has_work():
        engine.step()
        engine.pages.check_invariants(engine.scheduler.all_seqs())
    counters = engine.pages.counters
    assert counters.swap_outs + counters.recomputes > 0, "the pool was meant to be too small for all 8"
    assert sum(h.result().cached_tokens for h in handles) > 0, "the system prompt's pages were shared"
    for prompt, handle in zip(prompts, handles):
        assert_same_greedy(ref, prompt, handle.result().token_ids, hf_greedy(ref, prompt, 20, NO_EOS))
    engine.shutdown()


# ---- rope kinds against transformers' own functions -----------------------------------------------------------
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("name", ROPES)
def test_rope_equals_transformers(name):
    params = ROPES[name]
    hf = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=512,
                     rope_parameters=dict(params))
    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    want, want_scale = init(hf)
    got, scale = Rope.from_params(dict(params), 10000.0, 512).inv_freq(32, 512)
    assert torch.equal(got, want) and scale == want_scale


@pytest.mark.parametrize("long", [False, True])
def test_longrope_equals_transformers(long):
    rotary = int(32 * 0.75)
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
              "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
              "long_factor": [1.0 + 2.0 * i for i in range(rotary // 2)]}
    hf = Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=4096,
                    original_max_position_embeddings=1024, rope_parameters=dict(params))
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=1025 if long else None)
    cfg = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "original_max_position_embeddings": 1024, "rope_parameters": params}
    got, scale = base_rope(cfg).inv_freq(32, 4096, long=long)
    assert torch.equal(got, want) and scale == want_scale


def test_unit_offset_norm_equals_gemma3s_bit_for_bit():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        ref = Gemma3RMSNorm(64, eps=1e-6)
        with torch.no_grad():
            ref.weight.normal_(0.0, 0.5)
        ref = ref.to(dtype)
        x = torch.randn(7, 64).to(dtype) * 3
        assert torch.equal(rms_norm_unit_offset(x, ref.weight.float() + 1.0, 1e-6), ref(x))


# ---- GGUF files of each family that has one, as llama.cpp writes them ----------------------------------------
# Mistral's GGUF files are Llama files (see families/mistral.py)
GGUF_FAMILIES = ["qwen3-untied", "smollm3-nope-every-4th", "gemma3-local-global", "phi3-longrope-partial"]
# llama.cpp's Q4_K_M on rows a whole number of 256-wide super-blocks: Q4_K, with v, down and the head in Q6_K.
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q8_0", "*": "Q4_K"}


def gguf_of(src, out, types: dict[str, str]):
    """src written as a GGUF with every matrix quantized (types by GGUF piece, "*" for the rest), converted; and
    transformers' model of src with those matrices replaced by the file's numbers (gguf's d*q+m)."""
    family = families.of_config(config_of(src))
    matrices = [n for n, t in load_file(src / "model.safetensors").items() if t.dim() == 2]
    qtype = {piece: gguf.GGMLQuantizationType[kind] for piece, kind in types.items()}
    path = write_tiny_gguf(src, out / "tiny.gguf", quantized=tuple(gguf_name(n, family.gguf.layer_names)
                                                                   for n in matrices),
                           qtype=qtype, blocks=lambda gname, arr: quantize(arr, qtype.get(
                               gname.split(".")[-2], qtype["*"]).name))
    folder = convert_gguf(path, out / "converted")
    ref = load_reference(src)
    weights = load_weights(folder, torch.float32, "cpu")
    ref.load_state_dict({n: weights[n].dense(torch.float32) for n in matrices if n in weights}, strict=False)
    return folder, path, ref


@pytest.mark.parametrize("types", slow_after([{"*": "Q8_0"}, Q4_K_M]), ids=["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_a_gguf_of_the_family_loads_packed_and_matches_transformers(name, types, tmp_path, monkeypatch, kernels):
    """The file's config is the folder's; its matrices run packed on pagedchat's kernels (transformers' tokens up
    to int8 activations' near-ties), and dequantized in float32 with the kernels off (bit for bit)."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    wide = dict(heads=4, head_dim=64) if types is Q4_K_M else {}  # K types need rows of whole 256-blocks
    src = make_tiny_model(tmp_path / "src", **{**FAMILIES[name], **wide})
    folder, path, ref = gguf_of(src, tmp_path, types)
    assert ModelConfig.from_folder(folder) == ModelConfig.from_folder(src)
    prompts = [prompt_of(load_tokenizer(folder), n, salt=n) for n in (9, 40)]
    expected = [hf_greedy(ref, p, 30, NO_EOS) for p in prompts]
    for kernel, near_tie in (("packed", NEAR_TIE_PACKED), ("off", NEAR_TIE)):
        if kernel == "off":
            kernels("off")
        engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="float32")
        packed = "packed" in engine.model.weight_precision
        assert packed == (kernel == "packed"), engine.model.weight_precision
        outs = engine.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
        engine.shutdown()
        for prompt, out, want in zip(prompts, outs, expected):
            assert_same_greedy(ref, prompt, out.token_ids, want, near_tie=near_tie)


# Gemma 2's template: it refuses a system turn outright (Gemma 3's folds it into the first user turn itself).
NO_SYSTEM_ROLE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_family_without_a_system_role_gets_it_in_the_first_user_turn(tmp_path):
    folder = make_tiny_model(tmp_path, "gemma3", layers=2)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = NO_SYSTEM_ROLE
    tok.save_pretrained(folder)
    engine = Engine(str(folder), kv_cache_memory="1MiB", autostart=False)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello fox"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    text = engine.tokenizer.decode(engine.encode_prompt(chat))
    assert text.startswith("<|im_start|>user\nbe brief\n\nhello fox<|im_end|>\n<|im_start|>assistant\nhi")
    engine.shutdown()


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     "unsupported rope scaling 'dynamic': pagedchat implements default, linear, llama3, yarn, longrope"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "final_logit_softcapping": 30.0},
     "unsupported Gemma3ForCausalLM: final_logit_softcapping is set"),
    ({"architectures": ["Gemma2ForCausalLM"]}, "unsupported architecture 'Gemma2ForCausalLM': pagedchat runs Llama"),
])
def test_what_no_family_runs_is_refused_in_one_line(tmp_path, change, message):
    cfg = {**config_of(make_tiny_model(tmp_path, "llama", layers=1)), **change}
    with pytest.raises(ModelError, match=re.escape(message)):
        ModelConfig.from_dict(cfg)


def test_the_gguf_reader_names_the_families_it_reads():
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2': pagedchat converts llama, qwen2, "
                                         "qwen3, smollm3, gemma3, phi3"):
        families.of_gguf("gpt2", "x.gguf")
