"""What one bench run is asked to do, and the one error it stops with."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from pagedchat.config import EngineOptions
from pagedchat.errors import PagedChatError

DEFAULT_CHATS = (1, 2, 4, 8, 16)
PEERS = ("transformers", "llama.cpp")  # what --against accepts


class BenchError(PagedChatError):
    """The bench cannot run as asked: one line, non-zero exit."""


def _positive_ints(value: str, what: str, example: str) -> tuple[int, ...]:
    """Distinct positive integers, comma-separated, sorted."""
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {value!r}: give {what} like {example}") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: {what} must be positive integers, like {example}")
    return tuple(counts)


def chat_counts(value: str) -> tuple[int, ...]:
    """argparse type for --chats: distinct positive counts, sorted."""
    return _positive_ints(value, "chat counts", "1,2,4,8")


def prompt_lengths(value: str) -> tuple[int, ...]:
    """argparse type for --prefill: distinct prompt lengths in tokens, sorted."""
    return _positive_ints(value, "prompt lengths", "512,2048,8192")


def peer_names(value: str) -> tuple[str, ...]:
    """argparse type for --against: one or more of PEERS, comma-separated, in the order given."""
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: --against takes {' or '.join(PEERS)}, or both comma-separated")
    return names


@dataclass(frozen=True)
class BenchConfig:
    model: str | None = None
    chats: tuple[int, ...] = DEFAULT_CHATS
    max_tokens: int = 128
    system_tokens: int = 300
    seed: int = 0
    repeat: int = 1
    against: tuple[str, ...] = ()
    kv_cache_memory: str | int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    device: str | None = None
    threads: int | None = None
    startup: bool = True  # time "start to model ready" in fresh processes
    bandwidth: bool = True  # measure the memory read bandwidth (bandwidth.py)
    speculative: str | None = None  # the engine's speculative decoding (None: its default)

    @property
    def engine(self) -> EngineOptions:
        """The engine measured, from the same record the app, ask and serve build theirs from; without a CPU tier,
        so the pool measured is the KV cache alone."""
        return EngineOptions(model=self.model, kv_cache_memory=self.kv_cache_memory, dtype=self.dtype,
                             kv_cache_dtype=self.kv_cache_dtype, device=self.device, threads=self.threads,
                             swap_space=0, speculative=self.speculative or "auto")


def write_json(json_path: str | None, figures: dict) -> None:
    """--json: the figures to FILE, or to stdout for '-'; nothing without the flag."""
    if not json_path:
        return
    text = json.dumps(figures, indent=2)
    if json_path == "-":
        print(text)
    else:
        Path(json_path).write_text(text + "\n")
