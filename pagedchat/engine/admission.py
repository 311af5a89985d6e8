"""Admitting a sequence across layer groups: the longest cached prefix that every group can serve.

A global group serves a match only with every page before it; a sliding-window group only with the pages in
reach of the window at the match point (vLLM's SlidingWindowManager matches the same way), so a system prompt
longer than the window is shared even after its early pages were evicted from the window group. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from pagedchat.engine.pages import MemoryCounters, chain_hashes
from pagedchat.engine.prefix_cache import PrefixCache
from pagedchat.engine.sequence import Sequence


@dataclass(frozen=True)
class Match:
    """What one group maps for an admission that starts computing at page `pages` (plus `partial` tokens):
    cached GPU pages from page `skip` on, then CPU-tier pages copied back; nothing before `skip`, which lies
    before the window of every token still to come."""

    skip: int
    gpu: tuple[int, ...]
    cpu: tuple[int, ...]
    source: int | None = None   # the cached page whose first `partial` tokens the admission copies
    partial: int = 0
    ready: bool = True          # False: this step's forward pass writes the source, so it is copied next step

    @property
    def pages(self) -> int:
        return self.skip + len(self.gpu) + len(self.cpu)

    def from_page(self, skip: int) -> Match:
        """The same match without its pages before `skip` (a window group's, once the start is known)."""
        drop = skip - self.skip
        gpu_drop = min(drop, len(self.gpu))
        return replace(self, skip=skip, gpu=self.gpu[gpu_drop:], cpu=self.cpu[drop - gpu_drop:])


class GroupPool(Protocol):
    """What admission asks of each group's pool (engine/block_manager.py, BlockManager)."""

    block_size: int
    counters: MemoryCounters
    prefix: PrefixCache

    def longest_match(self, hashes: list[int], limit: int) -> int: ...
    def match(self, hashes: list[int], pages: int) -> Match | None: ...
    def partial_match(self, tokens: list[int], hashes: list[int], match: Match) -> Match: ...
    def fits(self, match: Match, num_tokens: int) -> bool: ...
    def map_match(self, seq: Sequence, hashes: list[int], match: Match, num_tokens: int) -> None: ...
    def first_needed(self, num_tokens: int) -> int: ...


def common_match(groups: tuple[GroupPool, ...], hashes: list[int], tokens: list[int],
                 partial_page: bool = True) -> list[Match]:
    """Each group's part of the longest match all of them serve, with the longest partial page all extend it by
    (where partial_page). A window group serving n pages may not serve fewer (the earlier ones it then needs may
    be gone), so the length is lowered until every group agrees."""
    pages = len(hashes)
    while True:
        agreed = min(group.longest_match(hashes, pages) for group in groups)
        if agreed == pages:
            break
        pages = agreed
    matches = [group.match(hashes, pages) for group in groups]
    if partial_page:
        matches = [group.partial_match(tokens, hashes, m) for group, m in zip(groups, matches)]
    partial = min(m.partial for m in matches)
    start = pages * groups[0].block_size + partial
    # A window group maps nothing its window no longer reaches from the start (the match inside a page moves
    # it), so an admission holds no more pages than a running chat's window and chunk.
    return [replace(m, partial=partial, source=m.source if partial else None, ready=m.ready or not partial)
            .from_page(group.first_needed(start)) for group, m in zip(groups, matches)]


def _plan(groups: tuple[GroupPool, ...], hashes: list[int], tokens: list[int], token_budget: int,
          partial_page: bool) -> tuple[list[Match], int, int]:
    """The common match, where computing starts, and how many tokens this step computes."""
    matches = common_match(groups, hashes, tokens, partial_page)
    start = matches[0].pages * groups[0].block_size + matches[0].partial
    return matches, start, min(len(tokens) - start, token_budget)


def _fits(groups: tuple[GroupPool, ...], matches: list[Match], num_tokens: int) -> bool:
    return all(group.fits(m, num_tokens) for group, m in zip(groups, matches))


@dataclass(frozen=True)
class Admission:
    """Where an admitted sequence starts computing (the tokens before are cached), and how many tokens it
    computes this step: 0 when it was not admitted, for want of room or because it waits for a page this step
    writes. The scheduler sets its num_computed to start."""

    start: int
    num_tokens: int
    waits: bool = False


def admit(groups: tuple[GroupPool, ...], seq: Sequence, token_budget: int) -> Admission:
    """Map seq's cached prefix in every group and take pages for its first chunk, or change nothing (an
    Admission of 0 tokens) when a group has no room.

    The last prompt token is always computed: its logits pick the first new token. The first group counts the
    prefix-cache lookup of a sequence whose lookup is not counted yet (seq.prefix_counted). A prompt whose best
    match ends inside a page that this step writes waits for the next (engine/scheduler.py).
    """
    first = groups[0]
    bs = first.block_size
    hashes = chain_hashes(seq.token_ids, bs, (len(seq.token_ids) - 1) // bs)
    matches, start, n = _plan(groups, hashes, seq.token_ids, token_budget, partial_page=True)
    if not all(m.ready for m in matches):
        return Admission(start, 0, waits=True)
    fits = n > 0 and _fits(groups, matches, start + n)
    if not fits and n > 0 and matches[0].partial:
        # Copying a partial page pins its source beside the fresh page it is copied into: in a pool with no page
        # to spare, that one page more would keep the request out for good, so it is tried without.
        matches, start, n = _plan(groups, hashes, seq.token_ids, token_budget, partial_page=False)
        fits = n > 0 and _fits(groups, matches, start + n)
    if not fits:
        return Admission(start, 0)
    for group, m in zip(groups, matches):
        group.map_match(seq, hashes, m, start + n)
    if not seq.prefix_counted:
        first.counters.prefix_queries += len(seq.token_ids)
        first.counters.prefix_hits += start
        first.prefix.record_lookup(len(seq.token_ids), start)
    return Admission(start, n)
