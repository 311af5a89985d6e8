"""The CPU tier: pages in host memory that the GPU pool offloads to and swaps out into. No torch here."""

from __future__ import annotations

from collections import OrderedDict, deque

from pagedchat.engine.checks import require


class CpuTier:
    """Pages in host memory: cached pages offloaded from the GPU pool, and pages of swapped-out sequences.

    A CPU page is free, cached (content under a hash, reusable, least recently used evicted first), held by a
    swapped-out sequence, or read by this step's copies and freed after it.

    Invariants, checked by check(): every page is in exactly one of those four states; the hash index and the
    LRU name the same cached pages, each under one hash."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._by_hash: dict[int, int] = {}                      # hash -> CPU page
        self._hash_of: dict[int, int] = {}                      # CPU page -> hash
        self._lru: OrderedDict[int, None] = OrderedDict()       # cached CPU pages, oldest first
        self._held: set[int] = set()
        self._release_after_step: list[int] = []

    # ---- views
    def available(self) -> int:
        return len(self._free) + len(self._lru)

    def lookup(self, h: int) -> int | None:
        return self._by_hash.get(h)

    def num_cached(self) -> int:
        return len(self._by_hash)

    def num_held(self) -> int:
        return len(self._held)

    def free_pages(self) -> list[int]:
        return list(self._free)

    def cached_pages(self) -> dict[int, int]:
        """hash -> CPU page, for every cached page."""
        return dict(self._by_hash)

    def held_pages(self) -> set[int]:
        return set(self._held)

    # ---- changes
    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._lru.popitem(last=False)
        del self._by_hash[self._hash_of.pop(page)]
        return page

    def offload(self, h: int) -> int | None:
        """A CPU page to copy an evicted GPU page with hash h into, or None: no room, or the content is
        already here (e.g. swapped back in since), in which case that one copy counts as recently used."""
        if h in self._by_hash:
            self._lru.move_to_end(self._by_hash[h])
            return None
        if not self.available():
            return None
        page = self._take()
        self._by_hash[h] = page
        self._hash_of[page] = h
        self._lru[page] = None
        return page

    def hold(self) -> int:
        """A CPU page for a sequence being swapped out (the caller checked available())."""
        page = self._take()
        self._held.add(page)
        return page

    def release_cached(self, page: int) -> None:
        """A cached CPU page is being copied back to the GPU: stop advertising it, free it after the step."""
        self._forget(page)
        self._release_after_step.append(page)

    def release_held(self, page: int, *, after_step: bool) -> None:
        """A swapped-out sequence lets go of a page: at once (it finished), or after the step (it is read back)."""
        self._held.discard(page)
        (self._release_after_step if after_step else self._free).append(page)

    def drop(self, page: int) -> None:
        """Forget a cached page whose copy did not run (a failed step): its content is undefined."""
        if page in self._hash_of:
            self._forget(page)
            self._free.append(page)

    def _forget(self, page: int) -> None:
        del self._by_hash[self._hash_of.pop(page)]
        self._lru.pop(page, None)

    def end_step(self) -> None:
        self._free.extend(self._release_after_step)
        self._release_after_step.clear()

    def reconcile(self, held: set[int]) -> None:
        """After a fault: exactly `held` (the survivors' CPU tables) is held; every other non-cached page free."""
        self.end_step()
        self._held = set(held)
        self._free = deque(p for p in range(self.num_pages) if p not in held and p not in self._hash_of)
        for page in [p for p in self._hash_of if p in held]:
            self._forget(page)

    def check(self) -> None:
        cached = set(self._by_hash.values())
        require(set(self._lru) == cached and len(self._hash_of) == len(self._by_hash), "CPU cache index differs")
        require(all(self._hash_of[p] == h for h, p in self._by_hash.items()), "CPU cache hash differs")
        require(not set(self._free) & (cached | self._held) and not cached & self._held, "a CPU page is in two states")
        total = len(self._free) + len(cached) + len(self._held) + len(self._release_after_step)
        require(total == self.num_pages, "a CPU page leaked")
