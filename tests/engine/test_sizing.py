"""engine/sizing.py on its own: sizes and dtypes as users write them, and how big the page pool is planned."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedchat.engine import sizing
from pagedchat.engine.sizing import parse_bytes, parse_dtype, parse_quantize, plan_cache
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.family import LayerSpec, Rope, RopeKind

CPU = torch.device("cpu")


def config(context: int = 512) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=192,
                       num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       max_position_embeddings=context, tie_word_embeddings=True,
                       qkv_bias=False)


# 2 (K, V) x 3 layers x 2 kv heads x 16 dims x 4 bytes, times 16 tokens
FP32_PAGE = 2 * 3 * 2 * 16 * 4 * 16


@pytest.mark.parametrize("text,want", [("4096", 4096), ("256MiB", 256 * 2**20), ("1.5GB", 1_500_000_000),
                                       (" 2 gib ", 2 * 2**30), ("64k", 64_000), (".5KiB", 512), (7, 7),
                                       (None, None)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["", "MiB", "12 parsecs", "-1GB", "1e9"])
def test_parse_bytes_refuses_with_one_line_that_shows_the_form(bad):
    with pytest.raises(ValueError, match=r"cannot read .* as a size: write bytes or a number with a unit"):
        parse_bytes(bad)


def test_parse_dtype_names_and_the_cpu_default(monkeypatch):
    assert parse_dtype("bf16", CPU) is torch.bfloat16 and parse_dtype("FP16", CPU) is torch.float16
    assert parse_dtype(torch.float32, CPU) is torch.float32
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda native=native: native)
        assert parse_dtype(None, CPU) is want and parse_dtype("auto", CPU) is want
    with pytest.raises(ValueError, match="unknown dtype 'int3': use one of auto, float32, bfloat16, float16"):
        parse_dtype("int3", CPU)


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, _float32_by_default):
    real = _float32_by_default  # conftest pins the probe to False for the session and hands over the real one
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    assert not real(str(info))
    info.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert real(str(info))
    info.write_text("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert real(str(info))
    assert not real(str(tmp_path / "missing"))


def test_parse_quantize():
    assert parse_quantize(None) is None and parse_quantize("off") is None and parse_quantize("none") is None
    assert parse_quantize("INT4") == "int4" and parse_quantize("int8") == "int8"
    with pytest.raises(ValueError, match="unknown quantization 'q2': use int4, int8 or none"):
        parse_quantize("q2")


def test_a_given_size_is_cut_into_whole_pages_with_a_quarter_for_the_cpu_tier():
    plan = plan_cache(config(), torch.float32, CPU, 16, 10 * FP32_PAGE + 5, None)
    assert (plan.num_pages, plan.page_bytes, plan.reason) == (10, FP32_PAGE, "")
    assert plan.num_cpu_pages == (10 * FP32_PAGE + 5) // 4 // FP32_PAGE == 2
    half = plan_cache(config(), torch.bfloat16, CPU, 16, 10 * FP32_PAGE, 3 * FP32_PAGE)
    assert half.page_bytes == FP32_PAGE // 2 and half.num_pages == 20 and half.num_cpu_pages == 6


def test_pages_are_sized_in_their_own_dtypes_bytes():
    """The page dtype, not the activations', sets the bytes a token: int8 rows are 16 codes and a 4-byte scale."""
    budget = 12 * FP32_PAGE
    plans = {dtype: plan_cache(config(), dtype, CPU, 16, budget, 0)
             for dtype in (torch.float32, torch.bfloat16, torch.int8)}
    assert [p.page_bytes for p in plans.values()] == [FP32_PAGE, FP32_PAGE // 2, 2 * 3 * 2 * (16 + 4) * 16]
    assert [p.num_pages for p in plans.values()] == [12, 24, budget // (2 * 3 * 2 * 20 * 16)] == [12, 24, 38]


def test_a_size_below_one_page_is_refused_with_the_page_size():
    with pytest.raises(ValueError, match=rf"holds no page: one page of 16 tokens takes {FP32_PAGE} bytes"):
        plan_cache(config(), torch.float32, CPU, 16, FP32_PAGE - 1, None)


def test_the_default_pool_holds_at_most_16_full_contexts():
    """A tiny model's 16 contexts take far less than a tenth of this machine's memory: the ceiling decides."""
    plan = plan_cache(config(context=512), torch.float32, CPU, 16, None, None)
    assert plan.num_pages == 16 * 512 // 16
    assert plan.reason == "default: 10% of available memory, at most 2 GiB"


def windowed(context: int = 512) -> ModelConfig:
    """config()'s shape in Gemma 3's pattern: five layers with a 64-token window, then a global one."""
    rope = Rope(RopeKind.DEFAULT, 10000.0)
    layers = tuple(LayerSpec(rope, None if i == 5 else 64) for i in range(6))
    return replace(config(context), num_layers=6, layers=layers)


LAYER_PAGE = FP32_PAGE // 3  # one layer's page: 2 x 2 kv heads x 16 x 4 bytes x 16 tokens


def test_a_small_budget_gives_every_layer_group_the_same_pages():
    plan = plan_cache(windowed(), torch.float32, CPU, 16, 10 * 6 * LAYER_PAGE, 4 * 6 * LAYER_PAGE)
    assert [(g.window, g.layers, g.num_pages, g.num_cpu_pages) for g in plan.groups] == \
        [(None, (5,), 10, 4), (64, (0, 1, 2, 3, 4), 10, 4)]
    assert [g.page_bytes for g in plan.groups] == [LAYER_PAGE, 5 * LAYER_PAGE] and plan.page_bytes == 6 * LAYER_PAGE
    assert plan.num_pages == 10


def test_past_what_its_chats_windows_need_a_window_group_leaves_the_bytes_to_the_global_layers():
    budget = 1000 * 6 * LAYER_PAGE
    plan = plan_cache(windowed(), torch.float32, CPU, 16, budget, 0, max_seqs=4, max_tokens_per_step=64)
    cap = 4 * (64 // 16 + 1) + 64 // 16 + 1  # each chat's window and the page it straddles; a chunk; a pinned copy
    global_, window = plan.groups
    assert window.num_pages == cap
    assert global_.num_pages == (budget - cap * 5 * LAYER_PAGE) // LAYER_PAGE
    assert global_.num_pages * LAYER_PAGE + window.num_pages * 5 * LAYER_PAGE <= budget


def test_without_release_a_windowed_model_has_one_group_that_keeps_every_page():
    plan = plan_cache(windowed(), torch.float32, CPU, 16, 1000 * 6 * LAYER_PAGE, 0, max_seqs=4,
                      release_windows=False)
    assert [(g.window, g.layers, g.num_pages) for g in plan.groups] == [(None, tuple(range(6)), 1000)]

