"""How big the KV cache is: parsing user sizes and dtypes, and the default budget."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedchat.argtypes import parse_bytes  # noqa: F401 (the engine reads sizes from here)
from pagedchat.kernels import kv_pages
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.family import LayerGroup, layer_groups

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEFAULT_CPU_SHARE = 0.10       # of available memory, for the KV pool when no size is given
DEFAULT_CPU_CAP = 2 * 2**30
DEFAULT_GPU_SHARE = 0.60       # of free GPU memory after the weights


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run natively there, faster than fp32
    (docs/bench.md#the-bf16-engine-what-each-change-bought). Elsewhere bf16 is emulated."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:  # not Linux: no cheap way to ask, and fp32 is never the wrong answer
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", text) is not None


def default_dtype(device: torch.device, quantized: bool = False) -> torch.dtype:
    """What auto means on a CPU:
    - quantized weights (a GGUF's, or `--quantize`) where pagedchat's kernels run them: float32, whose
      activations their panels take. Even where the CPU computes bf16 natively they decode faster so than with
      bf16 activations (docs/bench.md#one-kernel-library), at twice the KV bytes a token;
    - else bf16 where the hardware computes it natively (half the KV cache, faster attention and dense matmuls);
    - else float32, but for quantized weights without pagedchat's kernels: packed on torch's int4 kernel they
      decode faster in bf16 than expanded to float32 (docs/bench.md#quantized-kernels-for-every-x86-64-level)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if quantized:
        from pagedchat.model import qmm, quant

        if qmm.ensure() is None:
            return torch.float32
        if quant.int4_available():
            return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def parse_dtype(value: str | torch.dtype | None, device: torch.device, quantized: bool = False) -> torch.dtype:
    """quantized: the model's weights are (a GGUF, or --quantize), which weighs on auto's choice."""
    if isinstance(value, torch.dtype):
        return value
    if value is None or str(value).lower() == "auto":
        return default_dtype(device, quantized)
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}: use one of auto, float32, bfloat16, float16") from None


QUANTIZE_CHOICES = ("int4", "int8")


def parse_quantize(value: str | None) -> str | None:
    """`--quantize`: None (weights as the file holds them), int4 or int8 (group-wise, weight-only)."""
    if value is None or str(value).lower() in ("", "none", "off"):
        return None
    if str(value).lower() not in QUANTIZE_CHOICES:
        raise ValueError(f"unknown quantization {value!r}: use int4, int8 or none")
    return str(value).lower()


@dataclass(frozen=True)
class GroupPlan:
    """One layer group's pool (see model/family.py, LayerGroup): its pages on the GPU and in the CPU tier."""

    window: int | None        # the window its pages are released by; None: a group that keeps them
    layers: tuple[int, ...]
    num_pages: int
    num_cpu_pages: int
    page_bytes: int           # one page: block_size tokens of K and V in each of its layers


@dataclass(frozen=True)
class CachePlan:
    num_pages: int            # the first group's (the only one's, in a model without windows)
    num_cpu_pages: int
    page_bytes: int           # one page across every layer: what a sequence's block costs in all groups together
    reason: str  # how the default was chosen; empty when the user gave a size
    groups: tuple[GroupPlan, ...] = ()


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_cache(config: ModelConfig, kv_dtype: torch.dtype, device: torch.device, block_size: int,
               kv_bytes: int | None, swap_bytes: int | None, *, max_seqs: int = 64, max_tokens_per_step: int = 512,
               release_windows: bool = True) -> CachePlan:
    """kv_dtype: the pages' (kernels/kv_pages.py), whose bytes a token decide how many pages the budget buys."""
    page_bytes = kv_pages.token_bytes(config, kv_dtype) * block_size
    reason = ""
    if kv_bytes is None:
        # Never more than 16 sequences at full context would use.
        ceiling = 16 * config.max_position_embeddings * page_bytes // block_size
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_bytes = min(int(free * DEFAULT_GPU_SHARE), ceiling)
            reason = f"default: {DEFAULT_GPU_SHARE:.0%} of free GPU memory"
        else:
            kv_bytes = min(int(_available_host_memory() * DEFAULT_CPU_SHARE), DEFAULT_CPU_CAP, ceiling)
            reason = f"default: {DEFAULT_CPU_SHARE:.0%} of available memory, at most {DEFAULT_CPU_CAP >> 30} GiB"
    if kv_bytes // page_bytes < 1:
        raise ValueError(f"kv_cache_memory of {kv_bytes} bytes holds no page: one page of {block_size} tokens "
                         f"takes {page_bytes} bytes for this model")
    swap = kv_bytes // 4 if swap_bytes is None else swap_bytes
    # A config built by hand may list no layer recipes: its layers are then all global.
    grouped = layer_groups(config.layers, release_windows) or (LayerGroup(None, tuple(range(config.num_layers))),)
    groups = split_groups(grouped, page_bytes // config.num_layers, kv_bytes,
                          swap, block_size, window_cap=lambda w: max_seqs * (-(-w // block_size) + 1)
                          + -(-max_tokens_per_step // block_size) + 1)
    return CachePlan(groups[0].num_pages, groups[0].num_cpu_pages, page_bytes, reason, groups)


def split_groups(groups: tuple[LayerGroup, ...], layer_page_bytes: int, kv_bytes: int, swap_bytes: int,
                 block_size: int, window_cap: Callable[[int], int]) -> tuple[GroupPlan, ...]:
    """The byte budget cut into each layer group's pages.

    Without release every sequence holds as many pages in each group as in any other, so each group gets the
    same number of pages: the budget over a page of every layer. A window group whose sequences release what
    their window passed never holds more than window_cap(window) pages (each of max_seqs sequences: its window,
    plus the page the window straddles; plus one step's prefill chunks and a copy source pinned by an admission,
    engine/block_manager.py, most_pages): past that cap its pages would only keep released content cached, so
    the bytes go to the global groups, whose sequences keep every page. A model
    whose every group is windowed keeps the equal split (nothing else could use the bytes). The CPU tier is
    split equally: a swapped-out sequence holds only its live pages there."""
    full = layer_page_bytes * sum(len(g.layers) for g in groups)
    equal, cpu = kv_bytes // full, swap_bytes // full
    pages = {g: equal for g in groups}
    if any(g.window is None for g in groups):
        for g in groups:
            if g.window is not None:
                pages[g] = min(equal, window_cap(g.window))
        left = kv_bytes - sum(pages[g] * len(g.layers) * layer_page_bytes for g in groups if g.window is not None)
        global_bytes = layer_page_bytes * sum(len(g.layers) for g in groups if g.window is None)
        for g in groups:
            if g.window is None:
                pages[g] = left // global_bytes
    return tuple(GroupPlan(g.window, g.layers, pages[g], cpu, len(g.layers) * layer_page_bytes) for g in groups)
