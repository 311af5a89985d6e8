"""PageGroups on its own: a global group that keeps its pages beside a sliding-window group that releases
what the window passed, moved together through admission, prefix sharing, forks, swaps and a failed step."""

from __future__ import annotations

from fake_engine import admit_waiting, make_seq, toks

from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.pages import chain_hashes
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.records import NULL_PAGE

BS = 4
WINDOW = 6          # a query at position p sees p - 5 .. p: at most 3 pages of 4
WINDOW_PAGES = 3    # ceil(WINDOW / BS) + 1: the pages a decoding window can straddle


def two_groups(global_pages: int = 32, window_pages: int = 8, cpu_pages: int = 0) -> PageGroups:
    return PageGroups((BlockManager(global_pages, BS, cpu_pages),
                       BlockManager(window_pages, BS, cpu_pages, group=1, window=WINDOW)))


def compute(pages: PageGroups, seq, n: int) -> None:
    """The rest of a step that computes seq's next n tokens, once its pages are there."""
    pages.register_full_pages(seq, seq.num_computed + n)
    pages.take_ops()
    seq.num_computed += n
    pages.end_step()


def step(pages: PageGroups, seq, n: int) -> None:
    """One engine step of n tokens for a running seq, as the scheduler and the core do it around a forward."""
    assert pages.prepare_write(seq, n)
    compute(pages, seq, n)


def admit(pages: PageGroups, seq, budget: int) -> int:
    n = admit_waiting(pages, seq, budget)
    assert n > 0
    compute(pages, seq, n)
    return n


def cached_prefix(pages: PageGroups, prefix: list[int]) -> list[int]:
    """A chat over prefix run to its end in chunks of 4 and freed, its pages left cached: their chain hashes."""
    a = make_seq(prefix + [900], "a")
    admit(pages, a, 4)
    while a.num_computed < len(a.token_ids):
        step(pages, a, 4 if a.num_computed + 4 <= len(a.token_ids) else 1)
    pages.free_seq(a)
    return chain_hashes(prefix, BS, len(prefix) // BS)


def live(table: list[int]) -> list[int]:
    return [p for p in table if p != NULL_PAGE]


def test_the_window_group_releases_what_its_window_passed_and_the_global_group_keeps_every_page():
    pages = two_groups()
    seq = make_seq(toks(41))
    admit(pages, seq, 4)
    while seq.num_computed < 41:
        step(pages, seq, 1)
        window_table = seq.table(1).block_table
        assert len(live(window_table)) <= WINDOW_PAGES, "a decoding window straddles at most three pages"
        assert window_table[:len(window_table) - len(live(window_table))] == [NULL_PAGE] * (
            len(window_table) - len(live(window_table))), "released entries are a leading run"
        pages.check_invariants([seq])
    global_table = seq.table(0).block_table
    assert live(global_table) == global_table and len(global_table) == 11, "global layers keep all"
    assert pages.prepare_write(seq, 1)
    # The next token (position 41) sees 36..41: pages 9 and 10; its write released pages 0..8.
    assert seq.table(1).block_table[:9] == [NULL_PAGE] * 9
    assert pages.groups[1].counters.window_released == 9
    assert pages.pages_used() == [11, 2]


def test_a_prompt_shared_past_the_window_needs_only_the_window_groups_pages_in_reach():
    """Chat A's early window pages are evicted; chat B on the same prefix still maps it: the global group's whole
    chain, and the window group's pages from the first page B's window reaches."""
    pages = two_groups(window_pages=6)
    prefix = toks(32, salt=1)
    hashes = cached_prefix(pages, prefix)
    window = pages.groups[1]
    assert hashes[0] not in window.prefix.cached, "the window pool is too small to keep A's first page cached"
    assert all(h in window.prefix.cached for h in hashes[6:8])
    assert all(h in pages.groups[0].prefix.cached for h in hashes)

    b = make_seq(prefix + [7, 8, 9], "b")
    n = admit_waiting(pages, b, 64)
    assert b.num_computed == 32 and n == 3 and b.cached_tokens == 32
    # B computes from position 32: its window reaches back to 27, page 6; pages 0..5 are not mapped at all.
    assert b.table(1).block_table[:6] == [NULL_PAGE] * 6
    assert [window.pool.pages[p].hash for p in b.table(1).block_table[6:8]] == hashes[6:8]
    assert b.table(0).block_table[:8] == [pages.groups[0].prefix.cached[h] for h in hashes]
    pages.check_invariants([b])


def test_a_window_group_that_lacks_a_page_in_reach_lowers_the_match_for_every_group():
    pages = two_groups(window_pages=6)
    prefix = toks(32, salt=2)
    hashes = cached_prefix(pages, prefix)
    window = pages.groups[1]
    filler = make_seq(toks(20, salt=3), "filler")  # takes the window pool's free and least recent pages
    admit(pages, filler, 20)
    served = [i for i, h in enumerate(hashes) if h in window.prefix.cached]
    b = make_seq(prefix + [7], "b")
    admit_waiting(pages, b, 64)
    # The longest match is the one whose pages in reach the window group still holds, shorter than the
    # global group's, and the global group maps only that much too.
    assert b.num_computed % BS == 0 and b.num_computed < 32
    start = b.num_computed // BS
    first = max(0, b.num_computed - WINDOW + 1) // BS
    assert all(i in served for i in range(first, start))
    assert len(b.table(0).block_table) == len(b.table(1).block_table)
    pages.check_invariants([filler, b])


def test_a_fork_shares_the_live_window_pages_and_the_released_entries_stay_released():
    pages = two_groups()
    parent = make_seq(toks(30), "p")
    admit(pages, parent, 30)
    assert pages.prepare_write(parent, 1)  # releases what position 30's window passed
    child = make_seq(toks(30), "c")
    child.num_computed = parent.num_computed  # as the core does before a fork
    pages.fork(parent, child)
    assert child.table(1).block_table == parent.table(1).block_table
    assert NULL_PAGE in child.table(1).block_table
    pages.check_invariants([parent, child])
    pages.free_seq(parent)
    pages.check_invariants([child])
    assert all(pages.groups[1].pool.pages[p].ref == 1 for p in live(child.table(1).block_table))


def test_a_swapped_out_sequence_parks_only_its_live_window_pages_and_comes_back_with_its_released_entries():
    pages = two_groups(cpu_pages=16)
    seq = make_seq(toks(29))
    admit(pages, seq, 29)
    assert pages.prepare_write(seq, 1)
    released = seq.table(1).block_table.count(NULL_PAGE)
    assert released > 0
    assert pages.swap_out(seq)
    pages.take_ops()
    pages.end_step()
    assert seq.table(1).cpu_table[:released] == [NULL_PAGE] * released
    assert pages.groups[1].cpu.num_held() == len(seq.table(1).cpu_table) - released
    pages.check_invariants([seq])
    assert pages.swap_in(seq, 1)
    assert seq.table(1).block_table[:released] == [NULL_PAGE] * released
    ops = pages.take_ops()
    copied = [dst for _, dst in ops[1].swap_in]
    assert copied and set(copied) <= set(live(seq.table(1).block_table)), "only live pages come back"
    assert all(src != NULL_PAGE for src, _ in ops[1].swap_in)
    pages.end_step()
    pages.check_invariants([seq])


def test_a_failed_step_fails_the_sequence_whose_window_pages_it_was_copying_and_repairs_both_groups():
    pages = two_groups(window_pages=16, cpu_pages=16)
    seq, other = make_seq(toks(29), "s"), make_seq(toks(9, salt=5), "o")
    admit(pages, seq, 29)
    admit(pages, other, 9)
    assert pages.prepare_write(seq, 1)
    assert pages.swap_out(seq)
    pages.take_ops()
    pages.end_step()
    assert pages.swap_in(seq, 1)  # its copies back never run: the step fails before them
    damage = pages.abort_step(copies_ran=False)
    assert any(d.touches(seq) for d in damage) and not any(d.touches(other) for d in damage)
    pages.free_seq(seq)
    pages.repair([other])
    assert pages.pages_used() == [len(other.table(0).block_table), len(live(other.table(1).block_table))]
