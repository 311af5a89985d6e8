"""Page bookkeeping without a model: prefix sharing, the cached pool, eviction order, copy-on-write, swapping.

The scheduler and the engine core over these pages are tested in test_engine_core.py; the fake model that
checks every K/V read (PageContents) lives in fake_engine.py.
"""

from __future__ import annotations

import copy

from fake_engine import PageContents, admit_waiting, make_seq, toks
from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.pages import chain_hashes
from pagedchat.engine.sequence import Sequence

BS = 16


def table_of(seq: Sequence) -> list[int]:
    """seq's block table in the lone group these tests run."""
    return seq.table(0).block_table


def hashes_of(seq: Sequence) -> list[int]:
    return seq.table(0).page_hashes


def cpu_of(seq: Sequence) -> list[int]:
    return seq.table(0).cpu_table


def prefill(bm: BlockManager, seq: Sequence, budget: int = 10**6) -> int:
    """What the scheduler and engine do for one admission step (no model)."""
    n = admit_waiting(bm, seq, budget)
    if n:
        bm.register_full_pages(seq, seq.num_computed + n)
        seq.num_computed += n
    return n


def decode(bm: BlockManager, seq: Sequence, token: int) -> None:
    """Sample `token`, then compute it (one decode step), as the engine does."""
    seq.token_ids.append(token)
    assert bm.prepare_write(seq, 1)
    bm.register_full_pages(seq, seq.num_computed + 1)
    seq.num_computed += 1


def state(bm: BlockManager):
    """Everything a failed allocation must leave alone: every field of the manager and of its parts."""
    parts = (bm.pool, bm.prefix, bm.cpu)
    pages = [(p.ref, p.hash, p.parent, p.tokens) for p in bm.pool.pages]

    def own(obj) -> dict:  # an object's fields but the parts it points at (compared on their own)
        return {k: v for k, v in vars(obj).items() if k != "pages" and not any(v is part for part in parts)}
    return copy.deepcopy((pages, own(bm), own(bm.pool), own(bm.prefix), own(bm.cpu)))


def seq_state(seq: Sequence):
    return (list(table_of(seq)), list(hashes_of(seq)), seq.num_computed, list(cpu_of(seq)), seq.prefix_counted)


# ---- prefix sharing and the cached pool ----------------------------------------------------------------------
def test_shared_prefix_maps_three_pages_and_takes_one():
    bm = BlockManager(16, BS)
    common = toks(48)
    a, b = make_seq(common + toks(7, 1), "a"), make_seq(common + toks(5, 2), "b")
    assert prefill(bm, a) == 55 and len(table_of(a)) == 4
    assert prefill(bm, b) == 5, "only the 5 tokens past the shared pages are computed"
    assert table_of(b)[:3] == table_of(a)[:3]
    assert table_of(b)[3] not in table_of(a)
    assert [bm.pool.pages[p].ref for p in table_of(a)] == [2, 2, 2, 1] and bm.pool.pages[table_of(b)[3]].ref == 1
    assert b.cached_tokens == 48 and bm.counters.prefix_hits == 48 and bm.counters.prefix_queries == 55 + 53
    assert bm.pool.num_available() == 16 - 5
    bm.check_invariants([table_of(a), table_of(b)])


def test_last_prompt_token_is_always_computed():
    """A prompt seen before still computes its last token: its logits pick the first new token. The rest of
    its last page comes from a copy of the cached one."""
    bm = BlockManager(8, BS)
    a = make_seq(toks(32), "a")
    prefill(bm, a)
    bm.end_step()  # a's pages are written once its step has run; only then can they be copied
    bm.free_seq(a)
    b = make_seq(toks(32), "b")
    assert prefill(bm, b) == 1 and b.cached_tokens == 31


def test_prefix_inside_a_page_is_copied_not_recomputed():
    """A shared prefix that ends inside a page: full pages are mapped, the partly matching page is copied
    (its source pinned until the step's copies have run), and only the tokens past the match are computed."""
    bm = BlockManager(8, BS)
    system = toks(20)  # one full page and 4 tokens into the next
    a = make_seq(system + toks(14, 1), "a")  # its second page fills up: a full page can be offered
    prefill(bm, a)
    late = make_seq(system + toks(6, 2), "late")
    used = bm.pool.num_available()
    admission = bm.admit(late, 10**6)
    assert admission.waits and admission.num_tokens == 0, "a page written in this very step is copied next step"
    assert table_of(late) == [] and bm.pool.num_available() == used, "a waiting admission takes nothing"
    bm.end_step()
    bm.take_ops()
    b = make_seq(system + toks(6, 2), "b")
    assert prefill(bm, b) == 6 and b.cached_tokens == 20
    assert table_of(b)[0] == table_of(a)[0] and table_of(b)[1] not in table_of(a)
    assert bm.take_ops().cow == [(table_of(a)[1], table_of(b)[1])]
    assert bm.pool.pages[table_of(a)[1]].ref == 2  # a's own reference and the pin
    bm.check_invariants([table_of(a), table_of(b)])
    bm.end_step()
    assert bm.pool.pages[table_of(a)[1]].ref == 1
    bm.check_invariants([table_of(a), table_of(b)])
    # A cached page with no owner left is pinned the same way, then goes back to the cached pool.
    source = table_of(a)[1]
    bm.free_seq(a)
    c = make_seq(system + toks(3, 3), "c")
    assert prefill(bm, c) == 3 and c.cached_tokens == 20
    assert table_of(a) == [] and not bm.pool.evictable, "the pinned source is not evictable while its copy is pending"
    bm.end_step()
    assert list(bm.pool.evictable) == [source]
    bm.check_invariants([table_of(b), table_of(c)])


def test_hit_on_freed_cached_pages_takes_them_out_of_the_pool():
    bm = BlockManager(8, BS)
    a = make_seq(toks(40), "a")
    prefill(bm, a)
    full = table_of(a)[:2]
    bm.free_seq(a)
    assert list(bm.pool.evictable) == full[::-1], "hashed pages stay cached, chain end first"
    assert table_of(a) == [] and bm.pool.num_available() == 8
    b = make_seq(toks(40) + [7], "b")
    assert prefill(bm, b) == 41 - 32
    assert table_of(b)[:2] == full and not bm.pool.evictable
    assert all(p not in bm.pool.free for p in table_of(b))
    assert [bm.pool.pages[p].ref for p in full] == [1, 1] and bm.pool.num_available() == 8 - 3
    bm.check_invariants([table_of(b)])


def test_failed_allocations_change_nothing():
    bm = BlockManager(6, BS, num_cpu_pages=4)
    a = make_seq(toks(40), "a")
    prefill(bm, a)
    cached = make_seq(toks(33, 5), "cached")
    prefill(bm, cached)
    bm.free_seq(cached)  # two cached pages and one free page are left
    assert len(bm.pool.evictable) == 2 and len(bm.pool.free) == 1
    bm.take_ops()

    # admit: shares a's two full pages, then needs 5 pages of its own; 3 are available
    big = make_seq(toks(32) + toks(80, 9), "big")
    before, before_seq = state(bm), seq_state(big)
    assert admit_waiting(bm, big) == 0
    assert state(bm) == before and seq_state(big) == before_seq and big.cached_tokens == 0

    # prepare_write: a wants 5 more pages at once
    before, before_seq = state(bm), seq_state(a)
    a.token_ids += toks(80, 3)
    assert not bm.prepare_write(a, 80)
    assert state(bm) == before and seq_state(a) == before_seq
    a.token_ids = a.token_ids[:40]

    # swap_in: a swapped-out sequence while another one holds every page
    assert bm.swap_out(a)
    filler = make_seq(toks(90, 4), "filler")
    assert prefill(bm, filler) == 90
    bm.take_ops()
    bm.end_step()
    before, before_seq = state(bm), seq_state(a)
    assert not bm.swap_in(a, 1)
    assert state(bm) == before and seq_state(a) == before_seq

    # swap_out: three pages, but the CPU tier has one left
    bm.free_seq(filler)
    other = make_seq(toks(40, 6), "other")
    prefill(bm, other)
    assert bm.cpu.available() == 1
    before, before_seq = state(bm), seq_state(other)
    assert not bm.swap_out(other)
    assert state(bm) == before and seq_state(other) == before_seq


def test_reused_page_loses_its_old_hash():
    bm = BlockManager(4, BS)
    a = make_seq(toks(40), "a")
    prefill(bm, a)
    old = dict(zip(hashes_of(a), table_of(a)))
    bm.free_seq(a)
    assert set(old) <= set(bm.prefix.cached)
    b = make_seq(toks(64, 1), "b")  # four pages of other tokens: both cached pages are reused
    prefill(bm, b)
    assert bm.counters.evictions == 2
    for h, page in old.items():
        assert h not in bm.prefix.cached and page in table_of(b)
    assert all(bm.pool.pages[p].hash == h for p, h in zip(table_of(b), hashes_of(b)))
    bm.free_seq(b)
    again = make_seq(toks(40), "again")
    assert prefill(bm, again) == 40 and again.cached_tokens == 0, "nothing of a may hit any more"


def test_eviction_order_lru_and_chain_end_first():
    bm = BlockManager(12, BS)
    a, b = make_seq(toks(49, 1), "a"), make_seq(toks(33, 2), "b")
    prefill(bm, a)
    prefill(bm, b)
    a_pages, b_pages = table_of(a)[:3], table_of(b)[:2]
    old_hashes = set(hashes_of(a)) | set(hashes_of(b))
    bm.free_seq(a)
    bm.free_seq(b)
    assert list(bm.pool.evictable) == [a_pages[2], a_pages[1], a_pages[0], b_pages[1], b_pages[0]]
    # using a's first page again makes it the most recently used
    c = make_seq(toks(16, 1) + [3], "c")
    prefill(bm, c)
    assert table_of(c)[0] == a_pages[0]
    bm.free_seq(c)
    order = [a_pages[2], a_pages[1], b_pages[1], b_pages[0], a_pages[0]]
    assert list(bm.pool.evictable) == order
    # take the free pages, then one page at a time: cached pages go in exactly that order
    hog = make_seq(toks(len(bm.pool.free) * BS, 7), "hog")
    prefill(bm, hog)
    evicted = []
    for step in range(5):
        hog.token_ids += toks(BS, 20 + step)
        assert bm.prepare_write(hog, BS)
        hog.num_computed += BS
        evicted.append(table_of(hog)[-1])
    assert evicted == order and bm.counters.evictions == 5 and not old_hashes & set(bm.prefix.cached)


# ---- decode --------------------------------------------------------------------------------------------------
def test_decode_append_takes_a_page_only_at_a_boundary():
    bm = BlockManager(8, BS)
    seq = make_seq(toks(20), "d")
    prefill(bm, seq)
    assert len(table_of(seq)) == 2 and len(hashes_of(seq)) == 1
    for token in range(12):  # positions 20..31: inside page 1
        available = bm.pool.num_available()
        decode(bm, seq, token)
        assert len(table_of(seq)) == 2 and bm.pool.num_available() == available
        filled = seq.num_computed == 32
        assert len(hashes_of(seq)) == (2 if filled else 1)
    page1 = table_of(seq)[1]
    assert bm.pool.pages[page1].hash == hashes_of(seq)[1] == chain_hashes(seq.token_ids, BS, 2)[1]
    assert bm.prefix.cached[hashes_of(seq)[1]] == page1
    available = bm.pool.num_available()
    decode(bm, seq, 99)  # position 32: a new page
    assert len(table_of(seq)) == 3 and bm.pool.num_available() == available - 1
    assert bm.pool.pages[table_of(seq)[2]].hash is None
    bm.check_invariants([table_of(seq)])


# ---- fork and copy-on-write ----------------------------------------------------------------------------------
def forked(num_tokens: int) -> tuple[BlockManager, Sequence, Sequence]:
    """A pool of 10 pages, a parent prefilled with num_tokens, and a child forked from it."""
    bm = BlockManager(10, BS)
    parent = make_seq(toks(num_tokens), "parent")
    prefill(bm, parent)
    child = make_seq(parent.token_ids, "child")
    child.num_computed = parent.num_computed  # as the core does before a fork
    bm.fork(parent, child)
    return bm, parent, child


def test_fork_shares_every_page_and_copies_on_first_write():
    bm, parent, child = forked(40)
    assert table_of(child) == table_of(parent) and child.num_computed == 40
    assert [bm.pool.pages[p].ref for p in table_of(parent)] == [2, 2, 2], "the partial last page is shared too"
    bm.check_invariants([table_of(parent), table_of(child)])
    bm.take_ops()

    shared = list(table_of(child))
    child.token_ids.append(5)
    assert bm.prepare_write(child, 1)
    ops = bm.take_ops()
    assert len(ops.cow) == 1 and ops.cow[0][0] == shared[2]
    new = ops.cow[0][1]
    assert table_of(child) == shared[:2] + [new], "only the written index changes"
    assert table_of(parent) == shared and new not in shared
    assert [bm.pool.pages[p].ref for p in shared] == [2, 2, 1] and bm.pool.pages[new].ref == 1
    assert bm.counters.cow_copies == 1
    # the parent now owns its partial page alone: no copy
    parent.token_ids.append(6)
    assert bm.prepare_write(parent, 1) and not bm.take_ops().cow
    bm.check_invariants([table_of(parent), table_of(child)])
    bm.free_seq(parent)
    bm.free_seq(child)
    bm.check_invariants([])
    assert bm.pool.num_available() == 10


def test_fork_at_a_page_boundary_needs_no_copy():
    bm, parent, child = forked(32)
    child.token_ids.append(1)
    assert bm.prepare_write(child, 1)
    ops = bm.take_ops()
    assert not ops.cow and table_of(child)[:2] == table_of(parent) and len(table_of(child)) == 3


# ---- duplicates: kept, not merged ----------------------------------------------------------------------------
def test_duplicate_pages_are_kept_private_and_freed_uncached():
    """Two sequences prefill the same prompt before either page is full: the second gets its own copy. It is not
    merged into the first (its table is not remapped) and, unhashed, goes straight back to the free pool."""
    bm = BlockManager(8, BS)
    a, b = make_seq(toks(40), "a"), make_seq(toks(40), "b")
    assert prefill(bm, a, 10) == 10 and prefill(bm, b, 10) == 10  # no full page yet: nothing to hit
    for seq in (a, b):  # the rest of both prompts, a first
        assert bm.prepare_write(seq, 30)
        bm.register_full_pages(seq, 40)
        seq.num_computed = 40
    assert not set(table_of(a)) & set(table_of(b))
    assert hashes_of(a) == hashes_of(b)
    assert [bm.prefix.cached[h] for h in hashes_of(a)] == table_of(a)[:2]
    assert all(bm.pool.pages[p].hash is None for p in table_of(b)), "b's duplicate pages are not advertised"
    assert all(bm.pool.pages[p].ref == 1 for p in table_of(a) + table_of(b))
    a_full = table_of(a)[:2]
    bm.free_seq(b)
    assert not bm.pool.evictable and len(bm.pool.free) == 8 - 3, "duplicates go straight back to the free pool"
    bm.free_seq(a)
    assert list(bm.pool.evictable) == a_full[::-1]
    # a third request with that prompt maps a's pages
    c = make_seq(toks(40), "c")
    assert prefill(bm, c) == 8 and table_of(c)[:2] == a_full


# ---- swapping and the CPU tier -------------------------------------------------------------------------------
def test_swap_out_and_in_remaps_cached_pages_without_copying():
    bm = BlockManager(8, BS, num_cpu_pages=4)
    a = make_seq(toks(40), "a")
    prefill(bm, a)
    pages = list(table_of(a))
    assert bm.swap_out(a)
    ops = bm.take_ops()
    assert [g for g, _ in ops.swap_out] == pages and len(cpu_of(a)) == 3 and not table_of(a)
    assert bm.cpu.held_pages() == set(cpu_of(a)) and bm.counters.swap_outs == 1
    assert list(bm.pool.evictable) == pages[:2][::-1], "its hashed pages stay cached on the GPU"
    assert bm.swap_in(a, 1)
    ops = bm.take_ops()
    assert table_of(a)[:2] == pages[:2], "still-cached full pages are mapped again"
    assert len(ops.swap_in) == 1 and ops.swap_in[0][1] == table_of(a)[2]
    assert not bm.cpu.held_pages() and len(bm.cpu.free_pages()) < 4, "the read CPU page is freed after the step"
    bm.end_step()
    assert len(bm.cpu.free_pages()) == 4
    bm.check_invariants([table_of(a)])


def test_swap_in_makes_room_for_the_next_tokens():
    """A sequence swapped out with a full last page comes back with the page its next token goes to."""
    bm = BlockManager(8, BS, num_cpu_pages=4)
    s = make_seq(toks(32), "s")
    prefill(bm, s)
    s.token_ids.append(7)  # sampled, not computed yet
    old = list(table_of(s))
    assert bm.swap_out(s)
    bm.take_ops()
    bm.end_step()
    available = bm.pool.num_available()
    assert bm.swap_in(s, 1)
    assert table_of(s)[:2] == old and len(table_of(s)) == 3, "2 cached pages mapped again, 1 new page"
    assert bm.pool.num_available() == available - 3 and bm.pool.pages[table_of(s)[2]].ref == 1
    bm.check_invariants([table_of(s)])


def test_evicted_cached_pages_are_offloaded_and_swapped_back_in():
    bm = BlockManager(3, BS, num_cpu_pages=4)
    a = make_seq(toks(33), "a")
    prefill(bm, a)
    bm.free_seq(a)
    b = make_seq(toks(48, 1), "b")
    prefill(bm, b)
    ops = bm.take_ops()
    assert len(ops.swap_out) == 2 and bm.counters.offloads == 2 and bm.cpu.num_cached() == 2
    bm.end_step()
    bm.free_seq(b)
    again = make_seq(toks(33) + [5], "again")
    assert prefill(bm, again) == 34 - 32 and again.cached_tokens == 32
    ops = bm.take_ops()
    assert len(ops.swap_in) == 2 and [g for _, g in ops.swap_in] == table_of(again)[:2]
    assert [bm.pool.pages[p].hash for p in table_of(again)[:2]] == hashes_of(again)[:2]


def test_swap_in_of_cached_pages_is_not_overwritten_by_offloads():
    """A full CPU tier, a GPU pool of cached pages only, and a chat coming back to two offloaded pages: the
    offloads that taking GPU pages causes must not land in the CPU pages this very step reads from."""
    bm = BlockManager(3, BS, num_cpu_pages=2)
    sim = PageContents(bm)
    x = make_seq(toks(33), "x")
    sim.prefill(x)
    bm.free_seq(x)
    y = make_seq(toks(48, 1), "y")  # evicts x's two pages to the CPU tier and fills the GPU with cached pages
    sim.prefill(y)
    bm.free_seq(y)
    assert bm.cpu.num_cached() == 2 and not bm.cpu.free_pages() and not bm.pool.free
    back = make_seq(toks(33) + [5], "back")
    sim.prefill(back)
    assert back.cached_tokens == 32


def check_cpu(bm: BlockManager) -> None:
    bm.cpu.check()


def test_offloading_a_page_already_on_the_cpu_tier_keeps_one_copy():
    """A swapped-out sequence's pages are evicted (offloaded) while it waits; swapped back in, they are
    registered on the GPU again. Evicted once more, they are already on the CPU tier: one copy stays there,
    with one mapping, so later reuse of CPU pages cannot drop the wrong one."""
    bm = BlockManager(4, BS, num_cpu_pages=8)
    sim = PageContents(bm)
    s = make_seq(toks(33), "s")
    sim.prefill(s)
    assert bm.swap_out(s)
    sim.apply(bm.take_ops())
    bm.end_step()
    hog = make_seq(toks(64, 1), "hog")
    sim.prefill(hog)  # evicts s's two cached pages to the CPU tier
    assert bm.counters.offloads == 2 and set(hashes_of(s)) <= set(bm.cpu.cached_pages())
    bm.free_seq(hog)
    assert bm.swap_in(s, 1)
    sim.apply(bm.take_ops())
    bm.end_step()
    sim.check(s, 33)
    assert all(bm.prefix.cached.get(h) == p for h, p in zip(hashes_of(s), table_of(s)))
    bm.free_seq(s)
    check_cpu(bm)
    for salt in range(2, 8):  # churn through every GPU and CPU page
        h = make_seq(toks(64, salt), "churn")
        sim.prefill(h)
        bm.free_seq(h)
        check_cpu(bm)
    bm.check_invariants([])
