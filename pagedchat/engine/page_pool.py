"""One layer group's GPU pages: who maps them, which are free, and which cached one goes first.

A page is USED while some block table maps it (ref > 0). When its last user lets go, a page that carries a
chain hash (the prefix cache advertises it, engine/prefix_cache.py) stays CACHED, content intact, in the
evictable LRU; a page without one goes straight back to FREE. A page for new content is a free one, else the
least recently used cached one: that is the eviction rule, and it lives here alone. No torch here.

Invariants, kept by the methods below and checked by check():
- a page's ref is the number of block tables that map it, plus one while it is pinned as a copy source;
- every page is in exactly one place: `free` (ref 0, no hash), `evictable` (ref 0, a hash) or in use (ref > 0);
- `evictable` is ordered least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pagedchat.engine.checks import require
from pagedchat.engine.pages import Page
from pagedchat.engine.records import PageState


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.pages = [Page(i) for i in range(num_pages)]
        self.free: deque[int] = deque(range(num_pages))        # pages holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; least recently used first

    # ---- views -------------------------------------------------------------------------------------------
    def num_available(self) -> int:
        """Pages a take() can hand out: free ones and cached ones nobody maps."""
        return len(self.free) + len(self.evictable)

    def num_cached(self) -> int:
        return len(self.evictable)

    def ref_counts(self) -> dict[int, int]:
        """page -> reference count, pages in use only."""
        return {p.index: p.ref for p in self.pages if p.ref}

    def page_states(self) -> list[PageState]:
        return [p.state for p in self.pages]

    # ---- changes -----------------------------------------------------------------------------------------
    def take(self) -> tuple[int, bool]:
        """A page for new content, with ref 1, and whether it was evicted: a free page, else the least recently
        used cached one, which still carries its old hash for the caller to unpublish (and offload)."""
        if self.free:
            page, evicted = self.free.popleft(), False
        else:
            page, evicted = self.evictable.popitem(last=False)[0], True
        self.pages[page].ref = 1
        return page, evicted

    def ref(self, page: int) -> None:
        """One more user of a page in use, or of a cached one (which leaves the evictable LRU)."""
        record = self.pages[page]
        if record.ref == 0:
            self.evictable.pop(page)
        record.ref += 1

    def unref(self, page: int) -> None:
        """One user less; the last one's going makes a hashed page the most recently used cached one."""
        record = self.pages[page]
        record.ref -= 1
        if record.ref == 0:
            if record.hash is not None:
                self.evictable[page] = None
            else:
                self.free.append(page)

    def unadvertised(self, page: int) -> None:
        """The prefix cache stopped advertising page: unused, it goes from the cached pool to the free one."""
        if page in self.evictable:
            del self.evictable[page]
            self.free.append(page)

    def reconcile(self, counts: list[int]) -> None:
        """After a fault: ref counts become `counts` (what surviving tables map), and the pools are rebuilt
        around them, the cached pages keeping their LRU order."""
        for record, count in zip(self.pages, counts):
            record.ref = count
        self.evictable = OrderedDict((p, None) for p in self.evictable if self.pages[p].state is PageState.CACHED)
        for record in self.pages:
            if record.state is PageState.CACHED and record.index not in self.evictable:
                self.evictable[record.index] = None
        self.free = deque(r.index for r in self.pages if r.state is PageState.FREE)

    def check(self, counts: list[int]) -> None:
        """The invariants above, given how many tables (and pins) map each page."""
        require(counts == [p.ref for p in self.pages], "ref counts differ from block tables")
        in_use = {p for p in range(self.num_pages) if counts[p]}
        require(not in_use & set(self.free), "a mapped page is in the free pool")
        require(not in_use & set(self.evictable), "a mapped page is in the cached pool")
        require(len(self.free) + len(self.evictable) + len(in_use) == self.num_pages, "a page leaked")
        require(all(self.pages[p].state is PageState.CACHED for p in self.evictable), "an evictable page is not cached")
        require(all(self.pages[p].state is PageState.FREE for p in self.free), "a free page is advertised")
