"""transformers' own model of a GGUF: its GGUF loader's dequantized tensors (gguf's d*q+m, its own q/k row
order) in a model built from the folder's config. What the quantized paths are compared with."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.utils import logging as hf_logging

from pagedchat.model.gguf import gguf_weights
from tiny_models import hf_greedy


def transformers_from_gguf(folder: Path, dtype: torch.dtype = torch.float32):
    """The model transformers builds from the GGUF that folder (a converted model) reads its weights from.
    (transformers' from_pretrained(gguf_file=...) does the same, but needs accelerate installed.)"""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tensors = load_gguf_checkpoint(str(gguf_weights(folder)), return_tensors=True, model_to_load=shell)["tensors"]
    finally:
        hf_logging.set_verbosity(verbosity)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # a tied head is the table
    model.tie_weights()
    return model.to(dtype).eval()


@functools.cache
def shared_reference(folder: Path, dtype: torch.dtype = torch.float32):
    """transformers_from_gguf built once a test process, for the tests that compare with the same model (the
    default model's takes many times the engine's whole run). Callers leave it as it is."""
    return transformers_from_gguf(folder, dtype)


def shared_greedy(folder: Path, dtype: torch.dtype, prompt: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """hf_greedy of shared_reference, each continuation computed once a test process."""
    return list(_greedy(folder, dtype, tuple(prompt), max_new_tokens, tuple(eos_ids)))


@functools.cache
def _greedy(folder: Path, dtype: torch.dtype, prompt: tuple[int, ...], max_new_tokens: int,
            eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(hf_greedy(shared_reference(folder, dtype), list(prompt), max_new_tokens, eos_ids))
