"""Paged KV-cache kernels (ships as `pagedchat.kernels`; never import it as top-level `kernels`).

`reference` holds the plain torch spec of every op and runs anywhere. `write_kv`, `paged_attention`
and `copy_pages` are the Triton versions with the same signatures; call them only when
`triton_available()`. Triton is imported on first use, so this package imports fine without it
(macOS), and so that TRITON_INTERPRET=1 set by a test before the first call still takes effect:
triton reads it when a kernel is decorated, i.e. when our kernel modules are first imported.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pagedchat.kernels import reference

__all__ = ["copy_pages", "paged_attention", "reference", "triton_available", "write_kv"]


def _interpret_env() -> bool:
    # Parsed as triton parses it.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def triton_available() -> bool:
    """Triton is installed and has something to run on: a CUDA device, or the CPU interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or _interpret_env()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    from pagedchat.kernels import cache_ops

    cache_ops.write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
) -> torch.Tensor:
    # The Triton module is not called `paged_attention`: importing it would rebind this
    # package attribute from this function to the submodule.
    from pagedchat.kernels import triton_attention

    return triton_attention.paged_attention(q, k_cache, v_cache, block_tables, context_lens,
                                            query_start_loc, scale, max_query_len, max_context_len)


def copy_pages(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    from pagedchat.kernels import cache_ops

    cache_ops.copy_pages(caches, src, dst)
