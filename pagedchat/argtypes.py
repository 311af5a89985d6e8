"""argparse types shared by the CLI and the bench, and the size parser the engine reads sizes with: a leaf module
without torch, so neither imports the other and the CLI parses its flags before torch loads."""

from __future__ import annotations

import argparse
import math
import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def positive_int(value: str) -> int:
    """argparse type for counts (threads, tokens, rounds): a whole number of at least 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return n


def parse_bytes(value: int | str | None) -> int | None:
    """256MiB, 1.5GB, 4096 -> bytes."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size: write bytes or a number with a unit like 256MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[unit])


def size_bytes(value: str) -> int:
    """argparse type for sizes: 4MiB, 1.5GB, 4096; at least a byte."""
    try:
        size = parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1 byte")
    return size


def _seconds(value: str, least: float, strictly: bool) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(x) or x < least or (strictly and x == least):
        raise argparse.ArgumentTypeError(f"{value!r} must be {'more than' if strictly else 'at least'} {least:g}")
    return x


def positive_float(value: str) -> float:
    """argparse type for timeouts: seconds, more than 0."""
    return _seconds(value, 0.0, strictly=True)


def non_negative_float(value: str) -> float:
    """argparse type for waits that may be none: seconds, at least 0."""
    return _seconds(value, 0.0, strictly=False)


# The KV pages' dtypes (`--kv-cache-dtype`, vLLM's name; kernels/kv_pages.py), here for the CLI, which loads no torch.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
