"""The inspector's pure renderers: a hand-built MemorySnapshot in, plain text (and styles) out. No app runs."""

from __future__ import annotations

from dataclasses import replace

from pagedchat.backends.base import MemoryUnavailable
from pagedchat.backends.remote_metrics import ServerMetrics
from pagedchat.engine.pages import MemoryCounters
from pagedchat.engine.records import NULL_PAGE, PageState
from pagedchat.engine.kv_snapshot import GroupMemory, MemorySnapshot, SequenceMemory
from pagedchat.tui.inspector import MAP_ROWS, MAX_TABLE_ROWS, fitted_parts, render_block_table, render_chats, \
    render_map, render_sharing, \
    render_summary
from pagedchat.tui.inspector_parts import ChatPages, fmt_bytes
from pagedchat.tui.inspector_remote import render_without_map

PAGE = 1024
A = ChatPages("a", "Parent chat", "red", request_id="req-a")
B = ChatPages("b", "Forked chat", "blue", request_id="req-b")
IDLE = ChatPages("c", "Idle chat", "green", pages=(6, 7), tokens=20)


def snap(num_pages: int = 10, **overrides) -> MemorySnapshot:
    """Two live chats sharing pages 0 and 1 (b forked mid-page 2 of a), an idle chat's pages 6-7 cached."""
    states = [PageState.FREE] * num_pages
    for p in (0, 1, 2, 3):
        states[p] = PageState.USED
    for p in (6, 7):
        states[p] = PageState.CACHED
    seqs = {"req-a": SequenceMemory("req-a", "running", 40, 39, [0, 1, 2], 0, 0),
            "req-b": SequenceMemory("req-b", "swapped", 36, 35, [0, 1, 3], 2, 32)}
    fields = dict(num_pages=num_pages, free_pages=num_pages - 4, cached_pages=2, block_size=16, page_bytes=PAGE,
                  ref_counts={0: 2, 1: 2, 2: 1, 3: 1}, page_states=states, shared_pages={0: ["req-a", "req-b"],
                  1: ["req-a", "req-b"]}, seqs=seqs, cpu_total=0, cpu_cached=0, cpu_swapped=0,
                  counters=MemoryCounters(prefix_queries=10, prefix_hits=4, swap_outs=1, cow_copies=3),
                  hit_rate=0.4, recent_hit_rate=0.5, live_tokens=76, contiguous_bytes=2 * 2048 * PAGE // 16)
    fields.update(overrides)
    return MemorySnapshot(**fields)


def test_summary_counts_pages_and_bytes():
    text = render_summary(snap()).plain
    assert "free pages  6 / 10" in text and "2 cached" in text
    assert "40% used" in text
    assert f"in use      4 pages  {fmt_bytes(4 * PAGE)}" in text
    assert "weights" not in text and "CPU tier" not in text  # unknown weights and no CPU tier: no line


def test_summary_shows_weights_and_the_cpu_tier_when_known():
    text = render_summary(snap(weight_bytes=3 * 2**20, weight_precision="Q4_1 as int4", cpu_total=8,
                               cpu_cached=1, cpu_swapped=2)).plain
    assert f"weights     3.0 MiB  pool {fmt_bytes(10 * PAGE)}" in text and "Q4_1 as int4" in text
    assert "CPU tier    3 / 8  2 swapped · 1 cached" in text


def test_summary_shows_the_pages_dtype_and_bytes_a_token_when_known():
    text = render_summary(snap(kv_dtype="int8", kv_token_bytes=12_240)).plain
    assert "holds       int8  12,240 B a token" in text
    assert "holds" not in render_summary(snap()).plain  # an older server's snapshot says nothing of it


def test_map_has_one_glyph_per_page_and_colours_owners():
    content = render_map(snap(), [A, B, IDLE], width=40)
    lines = content.plain.splitlines()
    assert lines[0] == "Page map"
    assert lines[1] == "◆◆██··░░··"  # shared, used by one, free, the idle chat's cached pages
    spans = {content.plain[s.start:s.end]: str(s.style) for s in content.spans}
    assert spans["░░"] == "green" and spans["◆◆"] == "bold red"  # cached pages keep their idle chat's colour


def test_map_groups_pages_past_its_cell_limit():
    lines = render_map(snap(num_pages=4000), [A], width=40).plain.splitlines()
    assert lines[0].startswith("Page map  (1 cell = ") and "pages)" in lines[0]
    group = int(lines[0].split("= ")[1].split()[0])
    cells = "".join(lines[1:-1])
    assert len(cells) == -(-4000 // group) and cells[0] == "◆"  # the busiest page stands for its group


def test_a_big_pool_keeps_the_map_to_its_rows():
    """A default pool (thousands of pages) drawn one cell per page took the whole panel."""
    lines = render_map(snap(num_pages=2340), [A], width=40).plain.splitlines()
    group = -(-2340 // (40 * MAP_ROWS))
    assert lines[0] == f"Page map  (1 cell = {group} pages)"
    assert len(lines[1:-1]) == MAP_ROWS and len("".join(lines[1:-1])) == -(-2340 // group)
    folded = render_map(snap(num_pages=2340), [A], width=40, rows=1).plain.splitlines()
    assert folded == [f"Page map  (1 cell = {-(-2340 // 40)} pages)", "◆" + "·" * 39]   # no legend


def test_a_short_panel_gets_a_smaller_map_then_folded_sections():
    """Each part and the blank row after it must leave the block table's heading inside the panel."""
    def rows_used(parts) -> int:
        return sum(part.plain.count("\n") + 2 for part in parts) + 1

    big = snap(num_pages=2340)
    tall = fitted_parts(big, [A, B], 40, height=60)
    assert tall[1] == render_map(big, [A, B], 40) and tall[2] == render_sharing(big, 40)
    short = fitted_parts(big, [A, B], 40, height=rows_used(tall) - 2)
    assert rows_used(short) <= rows_used(tall) - 2 and short[2] == tall[2]   # the map gave up rows
    assert short[1].plain.count("\n") < tall[1].plain.count("\n")
    tiny = fitted_parts(big, [A, B], 40, height=20)
    assert [p.plain.splitlines()[0] for p in tiny] == ["KV cache", f"Page map  (1 cell = {-(-2340 // 40)} pages)",
                                                        "Sharing and waste", "Chats"]
    assert tiny[2].plain.splitlines()[1] == "shared 2 · saves 2 pg · hits 40%" and rows_used(tiny) <= 20


def test_chats_show_status_tokens_pages_and_shared_counts():
    text = render_chats(snap(), [A, B, IDLE]).plain.splitlines()
    assert text[0] == "Chats"
    assert "Parent chat" in text[1] and "running" in text[1] and "40 tok   3 pg ◆2" in text[1]
    assert "swapped" in text[2] and "◆2 cpu 2" in text[2]
    assert "idle" in text[3] and "20 tok   2 pg" in text[3] and "◆" not in text[3]
    assert render_chats(snap(), []).plain.splitlines()[1] == "no chats"


def test_sharing_reports_savings_slack_and_counters():
    text = render_sharing(snap()).plain
    assert f"shared      2 pages  saves 2 ({fmt_bytes(2 * PAGE)})" in text
    assert "contiguous  256.0 KiB  2 × full context" in text and "paged       4.0 KiB  98% less" in text
    assert f"slack       {3 * 16 - 40 + 3 * 16 - 36} slots" in text
    assert "recent 50% · 4/10" in text and "out 1 · in 0" in text and "CoW 3" in text
    assert "no live requests" in render_sharing(snap(seqs={}, shared_pages={}, ref_counts={})).plain
    one = render_sharing(snap(shared_pages={0: ["req-a", "req-b"]}, ref_counts={0: 2, 1: 1, 2: 1, 3: 1})).plain
    assert "shared      1 page  saves 1" in one   # not "1 pages"
    assert "drafts" not in text   # no speculative decoding yet: no line
    drafts = render_sharing(snap(counters=MemoryCounters(drafted=40, accepted=30))).plain
    assert "drafts      75% kept  30/40" in drafts


def test_block_table_rows_map_blocks_to_pages_with_fill_and_ref():
    rows = render_block_table(snap(), B).plain.splitlines()
    assert rows[1] == "swapped · 36 tokens · 3 pages"
    assert rows[3].split() == ["0", "→", "0", "16/16", "2", "◆", "shared"]
    assert rows[5].split() == ["2", "→", "3", "4/16", "1"]
    idle = render_block_table(snap(), IDLE).plain.splitlines()
    assert idle[3].split()[-2:] == ["░", "cached"]
    assert "no chat in focus" in render_block_table(snap(), None).plain


def test_a_long_block_table_elides_its_middle():
    pages = list(range(100))
    states = [PageState.USED] * 100
    long = SequenceMemory("req-a", "running", 1600, 1600, pages, 0, 0)
    rows = render_block_table(snap(num_pages=100, page_states=states, seqs={"req-a": long},
                                   ref_counts={p: 1 for p in pages}), A).plain.splitlines()
    assert f"… {100 - MAX_TABLE_ROWS} more blocks …" in rows[3 + MAX_TABLE_ROWS // 2]
    assert rows[-1].split()[:3] == ["99", "→", "99"]


def test_without_a_page_map_the_server_figures_or_the_reason_show():
    [part] = render_without_map(MemoryUnavailable("the server has no memory endpoint"), [A])
    assert part.plain.splitlines()[-1] == "the server has no memory endpoint"
    metrics = ServerMetrics("vllm", kv_usage=0.25, num_pages=400, block_size=16, running=2, waiting=1)
    server, chats = (c.plain for c in render_without_map(metrics, [A, IDLE]))
    assert "25% used" in server and "~100 / 400" in server and "2 running · 1 waiting" in server
    assert "pages estimated: tokens / 16" in chats and "20 tok   ~2 pg" in chats and "… tok" in chats


def windowed() -> MemorySnapshot:
    """A Gemma-3-shaped pool: one global layer keeps its pages (the map's), five window layers released 6 of theirs."""
    return snap(page_bytes=PAGE, groups=(GroupMemory(None, 1, 10, 4, 2, PAGE, 0, 0),
                                         GroupMemory(24, 5, 8, 3, 1, 5 * PAGE, 6, 9)))


def test_a_model_with_windows_shows_each_groups_pages_in_bytes_and_what_its_windows_freed():
    text = render_summary(windowed()).plain
    assert f"in use      4 pages  {fmt_bytes(4 * PAGE + 3 * 5 * PAGE)}" in text, "every group's bytes"
    assert f"global      4 / 10 pg  1 layer · {fmt_bytes(4 * PAGE)}" in text
    assert f"window 24   3 / 8 pg  5 layers · {fmt_bytes(15 * PAGE)}" in text
    assert f"released    6 pages  {fmt_bytes(30 * PAGE)} by windows" in text
    with_weights = render_summary(replace(windowed(), weight_bytes=2**20)).plain
    assert f"pool {fmt_bytes(10 * PAGE + 8 * 5 * PAGE)}" in with_weights, "the pool is every group's pages"
    assert render_map(windowed(), [A, B], width=40).plain.splitlines()[0] == "Page map · global layers"
    assert "window" not in render_summary(snap()).plain, "one group: nothing about groups"


def test_a_block_released_by_its_window_shows_as_released_and_is_not_counted_as_held():
    seq = SequenceMemory("req-a", "running", 40, 39, [NULL_PAGE, 1, 2], 0, 0)
    view = snap(seqs={"req-a": seq})
    rows = render_block_table(view, A).plain.splitlines()
    assert rows[3].split() == ["0", "→", "—", "16/16", "released", "by", "the", "window"]
    assert rows[4].split()[:3] == ["1", "→", "1"]
    assert "40 tok   2 pg" in render_chats(view, [A]).plain

