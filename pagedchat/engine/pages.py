"""The plain records of paging: a page, its chain hash, the copies a step needs, the pool's counters.

No torch here, and no rules: page_pool.py, prefix_cache.py and block_manager.py decide what these hold.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from pagedchat.engine.records import PageState
from pagedchat.engine.records import NULL_PAGE
from pagedchat.engine.sequence import Sequence

HASH_BYTES = 16


def page_hash(parent: int | None, tokens: list[int]) -> int:
    """Chain hash of a full page: its tokens and, through the parent's hash, every token before them.

    The model, dtype and block size are fixed for an engine, so tokens and position are all that decide a
    page's K/V here. A hit maps the page without comparing tokens, and under `serve` the prompts are other
    people's, so the hash is a cryptographic digest (as vLLM's sha256): a collision of Python's hash() would
    hand one request another's KV.
    """
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=HASH_BYTES,
                             key=b"" if parent is None else parent.to_bytes(HASH_BYTES, "little"))
    return int.from_bytes(digest.digest(), "little")


def chain_hashes(tokens: list[int], block_size: int, num_pages: int, start: list[int] | None = None) -> list[int]:
    hashes = list(start or [])
    for i in range(len(hashes), num_pages):
        parent = hashes[-1] if hashes else None
        hashes.append(page_hash(parent, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass
class CopyPlan:
    """Page copies one step needs, run in this order before the forward pass."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # GPU page -> CPU page
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # CPU page -> GPU page
    cow: list[tuple[int, int]] = field(default_factory=list)       # GPU page -> GPU page (copy-on-write)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.cow)


@dataclass
class MemoryCounters:
    prefix_queries: int = 0     # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0        # of those, tokens served from cached pages
    evictions: int = 0          # cached pages dropped from the GPU pool
    offloads: int = 0           # cached pages saved to the CPU tier on eviction
    cpu_hits: int = 0           # cached pages a prefix hit copied back from the CPU tier
    swap_outs: int = 0          # sequences preempted by swapping to the CPU tier
    swap_ins: int = 0
    recomputes: int = 0         # sequences preempted by dropping their pages
    cow_copies: int = 0
    window_released: int = 0    # pages unmapped because every window of their sequence had passed them
    drafted: int = 0            # draft tokens verified (speculative decoding, engine/ngram.py)
    accepted: int = 0           # of those, tokens kept
    rolled_back: int = 0        # pages taken for draft tokens that were rejected, given back


@dataclass(eq=False, slots=True)
class Page:
    """One physical GPU page: who maps it and, once full, what it holds (as vLLM's KVCacheBlock)."""

    index: int
    ref: int = 0                          # block tables mapping it, plus a pin while it is a copy source
    hash: int | None = None               # chain hash of its content, while advertised for reuse
    parent: int | None = None             # the chain hash of the page before it
    tokens: tuple[int, ...] | None = None  # its tokens, for matches inside a page

    @property
    def state(self) -> PageState:
        if self.ref:
            return PageState.USED
        return PageState.FREE if self.hash is None else PageState.CACHED


def mapped(table: list[int]) -> list[int]:
    """A table's pages, without the entries a window released."""
    return [page for page in table if page != NULL_PAGE]


@dataclass(frozen=True)
class Damage:
    """The pages of one group whose content a failed step left undefined (see BlockManager.abort_step)."""

    group: int
    gpu: frozenset[int]
    cpu: frozenset[int]

    def touches(self, seq: Sequence) -> bool:
        table = seq.table(self.group)
        return not self.gpu.isdisjoint(table.block_table) or not self.cpu.isdisjoint(table.cpu_table)
