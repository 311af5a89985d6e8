"""Paged KV-cache kernels (ships as `pagedchat.kernels`; never import it as top-level `kernels`).

`reference` holds the plain torch spec of every op and runs anywhere. `write_kv` and `paged_attention`
are the Triton versions with the same signatures; call them only when
`triton_available()`. Triton is imported on first use, so this package imports fine without it
(macOS), and so that TRITON_INTERPRET=1 set by a test before the first call still takes effect:
triton reads it when a kernel is decorated, i.e. when our kernel modules are first imported.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedchat.kernels import reference
from pagedchat.kernels.env import interpret_env

__all__ = ["interpret_env", "paged_attention", "reference", "triton_available", "write_kv"]


def triton_available() -> bool:
    """Triton is installed and has something to run on: a CUDA device, or the CPU interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpret_env()


# The Triton ops, each found in its module when first asked for (module __getattr__, PEP 562), so that
# importing this package imports no Triton. The modules are not named after their ops: importing a submodule
# `paged_attention` would rebind this package's attribute from the op to the module.
_TRITON_OPS = {"write_kv": "cache_ops", "paged_attention": "triton_attention"}


def __getattr__(name: str):
    module = _TRITON_OPS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
