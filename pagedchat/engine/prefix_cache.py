"""Which GPU pages of one layer group hold reusable content, and how much of a prompt they serve.

A full page is published under the chain hash of its content (engine/pages.py, page_hash), so a later prompt
with the same prefix maps it instead of computing it again. Each published page is also indexed by its
parent's hash with its tokens, so a prompt that continues the same parent can copy the first tokens of a page
(a system prompt's partly filled last page, say). Mapping and eviction are the page pool's
(engine/page_pool.py); this index only says what is where. No torch here.

Invariants, kept by publish/unpublish and checked by check():
- `cached[h]` is a page whose record carries hash h, and one hash is advertised on one GPU page at most;
- `children` indexes exactly the pages of `cached`, each under its record's parent hash.
"""

from __future__ import annotations

from collections import deque

from pagedchat.engine.checks import require
from pagedchat.engine.cpu_tier import CpuTier
from pagedchat.engine.page_pool import PagePool


class PrefixCache:
    def __init__(self, pool: PagePool, block_size: int, cpu: CpuTier):
        self.pool = pool
        self.block_size = block_size
        self.cpu = cpu
        self.cached: dict[int, int] = {}                   # hash -> GPU page holding that content
        self.children: dict[int | None, set[int]] = {}     # parent hash -> published pages that follow it
        self.fresh: set[int] = set()                       # published this step: written by its forward pass
        self.recent_lookups: deque[tuple[int, int]] = deque(maxlen=64)  # (queried, hit) per admission

    def page_of(self, h: int) -> int | None:
        """The GPU page advertised under hash h, if any."""
        return self.cached.get(h)

    def publish(self, page: int, hashes: list[int], i: int, token_ids: list[int]) -> None:
        """Advertise page, logical block i of a sequence with these chain hashes and tokens: whole under its
        chain hash, and its tokens under its parent's hash (see partial)."""
        record = self.pool.pages[page]
        record.hash, record.parent = hashes[i], hashes[i - 1] if i else None
        record.tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
        self.cached[record.hash] = page
        self.children.setdefault(record.parent, set()).add(page)
        self.fresh.add(page)

    def unpublish(self, page: int) -> int:
        """Stop advertising page; returns the hash it had."""
        record = self.pool.pages[page]
        h = record.hash
        del self.cached[h]
        siblings = self.children[record.parent]
        siblings.discard(page)
        if not siblings:
            del self.children[record.parent]
        record.hash = record.parent = record.tokens = None
        return h

    def run(self, hashes: list[int], skip: int, limit: int) -> tuple[list[int], list[int]]:
        """The cached pages of hashes[skip:limit] in a run from skip: GPU ones, then CPU-tier ones (one hash is
        never advertised on two GPU pages), up to the first page cached nowhere."""
        gpu, cpu = [], []
        for h in hashes[skip:limit]:
            cpu_page = self.cpu.lookup(h)
            if h in self.cached and not cpu:
                gpu.append(self.cached[h])
            elif cpu_page is not None and h not in self.cached:
                cpu.append(cpu_page)
            else:
                break
        return gpu, cpu

    def partial(self, parent: int | None, tokens: list[int]) -> tuple[int | None, int]:
        """(page, n): the published page after `parent` whose first n tokens match the most of `tokens`, or
        (None, 0); of equal matches, one written before this step. A page published this step may be mapped
        the step it is written (attention reads after every write), but copied only from the next (copies run
        before the forward pass writes it): see written()."""
        best, best_n = None, 0
        for page in self.children.get(parent, ()) if tokens else ():
            n = 0
            for a, b in zip(self.pool.pages[page].tokens, tokens):
                if a != b:
                    break
                n += 1
            if n > best_n or (n == best_n and best in self.fresh and page not in self.fresh):
                best, best_n = page, n
        return best, best_n

    def written(self, page: int) -> bool:
        """Whether page's content was written by a step before this one."""
        return page not in self.fresh

    def end_step(self) -> None:
        """The step's forward pass wrote the pages published in it: they may be copy sources from now on."""
        self.fresh.clear()

    def record_lookup(self, queried: int, hit: int) -> None:
        self.recent_lookups.append((queried, hit))

    def check(self) -> None:
        pages = self.pool.pages
        require(all(pages[page].hash == h for h, page in self.cached.items()), "a cached page lost its hash")
        indexed = [p for group in self.children.values() for p in group]
        require(sorted(indexed) == sorted(self.cached.values()), "the index of page contents differs from the cache")
        require(all(pages[p].parent == parent for parent, group in self.children.items() for p in group),
                "a page is indexed under another parent")
