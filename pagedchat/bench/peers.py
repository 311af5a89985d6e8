"""What a peer looks like to the bench: named runners over the same prompts, an optional cold first token, and a
close. The peers themselves (hf, llamacpp) build these; `--against NAME` finds its loader in loaders.LOADERS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagedchat.bench.progress import Progress
from pagedchat.bench.stats import RunStats

# prompts, tokens per chat, progress -> the level's figures
RunLevel = Callable[[list[list[int]], int, Progress], RunStats]


@dataclass(frozen=True)
class Runner:
    key: str            # stable name in the JSON
    label: str          # as the tables and the progress bar show it
    every_round: bool   # alternates with pagedchat in each --repeat round; else runs once per level
    run: RunLevel


@dataclass(frozen=True)
class Peer:
    name: str
    runners: tuple[Runner, ...]
    close: Callable[[], None]
    # full prompts -> seconds to each one's first token, each alone on an empty cache
    cold_first_token: Callable[[list[list[int]]], list[float]] | None = None
    # fresh process -> seconds from its start to the model ready to decode
    startup: Callable[[], float] | None = None
    build: str = ""  # how the peer was built, for the bench's header

