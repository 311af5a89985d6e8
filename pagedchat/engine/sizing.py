"""How big the KV cache is: parsing user sizes and dtypes, and the default budget."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from pagedchat.argtypes import parse_bytes  # noqa: F401 (the engine reads sizes from here)
from pagedchat.model.config import ModelConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEFAULT_CPU_SHARE = 0.10       # of available memory, for the KV pool when no size is given
DEFAULT_CPU_CAP = 2 * 2**30
DEFAULT_GPU_SHARE = 0.60       # of free GPU memory after the weights


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX-512 BF16 or AMX: bf16 matmuls run natively there, faster than fp32 (docs/bench.md, "What each change
    bought"). Elsewhere bf16 is emulated."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:  # not Linux: no cheap way to ask, and fp32 is never the wrong answer
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", text) is not None


def default_dtype(device: torch.device, quantized: bool = False) -> torch.dtype:
    """bf16 where the hardware computes it natively (half the KV cache, faster attention and dense matmuls),
    else fp32, in which pagedchat's kernels run quantized weights packed. Where they are not built, quantized
    weights on a CPU without native bf16 still run faster packed on torch's int4 kernel, in bf16, than expanded
    to float32 (docs/bench.md, "Quantized kernels for every x86-64 level"): so bf16 there too."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_has_native_bf16():
        return torch.bfloat16
    if quantized:
        from pagedchat.model import qmm, quant

        if qmm.ensure() is not None and quant.int4_available():
            return torch.bfloat16
    return torch.float32


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
class CachePlan:
    num_pages: int
    num_cpu_pages: int
    page_bytes: int
    reason: str  # how the default was chosen; empty when the user gave a size


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_cache(config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int,
               kv_bytes: int | None, swap_bytes: int | None) -> CachePlan:
    page_bytes = config.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size()) * block_size
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
    num_pages = kv_bytes // page_bytes
    if num_pages < 1:
        raise ValueError(f"kv_cache_memory of {kv_bytes} bytes holds no page: one page of {block_size} tokens "
                         f"takes {page_bytes} bytes for this model")
    swap = kv_bytes // 4 if swap_bytes is None else swap_bytes
    return CachePlan(num_pages, swap // page_bytes, page_bytes, reason)
