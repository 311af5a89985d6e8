"""The page pool alone: ref counts, the free list, and which cached page an eviction takes (page_pool.py)."""

from __future__ import annotations

import pytest

from pagedchat.engine.checks import PoolCorrupted
from pagedchat.engine.page_pool import PagePool
from pagedchat.engine.records import PageState


def cached_pool(num_pages: int, hashed: list[int]) -> tuple[PagePool, list[int]]:
    """A pool whose every page was taken once, then released in page order; `hashed` ones carry a hash (as the
    prefix cache leaves a published page), so they stay cached rather than free."""
    pool = PagePool(num_pages)
    taken = [pool.take() for _ in range(num_pages)]
    assert all(not evicted for _, evicted in taken)
    pages = [page for page, _ in taken]
    for page in pages:
        if page in hashed:
            pool.pages[page].hash = 1000 + page
        pool.unref(page)
    return pool, pages


def test_take_prefers_a_free_page_and_then_evicts_the_least_recently_used_cached_one():
    pool, pages = cached_pool(5, hashed=[0, 1, 3])
    assert list(pool.free) == [2, 4] and list(pool.evictable) == [0, 1, 3]
    assert pool.num_available() == 5 and pool.num_cached() == 3
    assert [pool.take() for _ in range(2)] == [(2, False), (4, False)]
    pool.ref(0)       # a prefix hit maps page 0 again: it leaves the LRU...
    pool.unref(0)     # ...and its user's going makes it the most recently used
    assert list(pool.evictable) == [1, 3, 0]
    assert [pool.take() for _ in range(3)] == [(1, True), (3, True), (0, True)]
    assert pool.num_available() == 0
    assert all(pool.pages[p].hash is not None for p in (1, 3, 0)), "the caller unpublishes what was evicted"


def test_ref_counts_and_states_follow_the_users():
    pool = PagePool(3)
    page, _ = pool.take()
    pool.ref(page)
    assert pool.ref_counts() == {page: 2} and pool.page_states()[page] is PageState.USED
    pool.unref(page)
    pool.pages[page].hash = 7
    pool.unref(page)
    assert pool.ref_counts() == {} and pool.page_states() == [PageState.CACHED, PageState.FREE, PageState.FREE]
    pool.pages[page].hash = None  # the prefix cache stopped advertising it
    pool.unadvertised(page)
    assert pool.page_states() == [PageState.FREE] * 3 and sorted(pool.free) == [0, 1, 2]
    pool.check([0, 0, 0])


def test_reconcile_rebuilds_the_pools_around_the_surviving_counts():
    pool, _ = cached_pool(4, hashed=[1, 2])
    pool.ref(2)
    pool.ref(2)
    pool.pages[3].ref = 5  # a fault stopped an allocation halfway
    pool.reconcile([0, 0, 1, 0])
    pool.check([0, 0, 1, 0])
    assert list(pool.evictable) == [1] and sorted(pool.free) == [0, 3] and pool.ref_counts() == {2: 1}


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: setattr(pool.pages[0], "ref", 1), "ref counts differ"),
    (lambda pool: pool.free.append(1), "leaked"),
    (lambda pool: (pool.free.remove(0), pool.evictable.__setitem__(0, None)), "not cached"),
    (lambda pool: setattr(pool.pages[0], "hash", 3), "a free page is advertised"),
])
def test_check_finds_a_broken_invariant(corrupt, message):
    pool, _ = cached_pool(3, hashed=[1])
    pool.check([0, 0, 0])
    corrupt(pool)
    with pytest.raises(PoolCorrupted, match=message):
        pool.check([0, 0, 0])
