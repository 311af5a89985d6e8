"""argparse types shared by the CLI and the bench: a leaf module, so neither imports the other."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """argparse type for counts (threads, tokens, rounds): a whole number of at least 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return n
