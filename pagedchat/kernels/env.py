"""Whether Triton runs its kernels on the CPU (TRITON_INTERPRET): a leaf, so that the kernel modules can ask
without importing the package that imports them."""

from __future__ import annotations

import os


def interpret_env() -> bool:
    """TRITON_INTERPRET is set: Triton runs its kernels on the CPU. Parsed as triton parses it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
