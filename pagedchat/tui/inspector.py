"""The memory inspector: the engine's paged KV cache, drawn from a MemorySnapshot a few times a second.

Rendering is a pure function of (snapshot, chats, width), so it is testable and deterministic; the widget only
decides when to call it (when shown, on a timer) and skips the work when nothing changed. Colours come from the
active theme: chat colours from themes.chat_colours(), the rest as $variables resolved at render time.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from pagedchat.backends.base import has_page_map
from pagedchat.engine.records import NULL_PAGE
from pagedchat.text import visible_controls
from pagedchat.tui.inspector_parts import (CACHED, FREE, GLYPH_CACHED, GLYPH_FREE, GLYPH_SHARED, GLYPH_USED, MUTED,
                                           USED, ChatPages, fmt_bytes)
from pagedchat.tui.inspector_parts import clip as _clip
from pagedchat.tui.inspector_parts import heading as _heading
from pagedchat.tui.inspector_parts import kv as _kv
from pagedchat.tui.inspector_remote import render_without_map

MAP_ROWS = 6               # the map's height at most: past it, one cell stands for several pages
MAX_TABLE_ROWS = 48        # block-table rows shown before eliding the middle


def _owners(snap, chats: list[ChatPages]) -> tuple[dict[int, ChatPages], dict[int, ChatPages]]:
    """Page -> chat for live pages, and for cached pages idle chats remember."""
    by_request = {c.request_id: c for c in chats if c.request_id}
    live: dict[int, ChatPages] = {}
    for rid, seq in snap.seqs.items():
        chat = by_request.get(rid)
        if chat is not None:
            for p in seq.pages:
                live.setdefault(p, chat)
    idle: dict[int, ChatPages] = {}
    for chat in chats:
        for p in chat.pages:
            if p < len(snap.page_states) and snap.page_states[p] == CACHED:
                idle[p] = chat
    return live, idle


def render_summary(snap, width: int = 80) -> Content:
    used = snap.used_pages
    pct = used / snap.num_pages if snap.num_pages else 0.0
    bar_w = max(8, min(24, width - 10))
    filled = round(pct * bar_w)
    bar = Content.assemble(Content.styled("█" * filled, "$accent"),
                           Content.styled("░" * (bar_w - filled), MUTED),
                           f" {pct:4.0%} used")
    lines = [
        _heading("KV cache"),
        _kv("free pages", Content.styled(f"{snap.free_pages} / {snap.num_pages}", "bold"),
            f"{snap.cached_pages} cached", width),
        bar,
        _kv("page", f"{snap.block_size} tokens", fmt_bytes(snap.page_bytes), width),
        *([_kv("holds", snap.kv_dtype, f"{snap.kv_token_bytes:,} B a token", width)] if snap.kv_dtype else []),
        _kv("in use", f"{used} pages", fmt_bytes(snap.paged_bytes), width),
        *render_groups(snap, width),
    ]
    if snap.weight_bytes:  # weights and pages share one memory: what the model takes is what the pool cannot
        lines.append(_kv("weights", fmt_bytes(snap.weight_bytes),
                         f"pool {fmt_bytes(snap.pool_bytes)}", width))
        if snap.weight_precision:
            lines.append(_kv("", visible_controls(snap.weight_precision), "", width))
    if snap.cpu_total:
        lines.append(_kv("CPU tier", f"{snap.cpu_used} / {snap.cpu_total}",
                         f"{snap.cpu_swapped} swapped · {snap.cpu_cached} cached", width))
    return Content("\n").join(lines)


def _group_name(group) -> str:
    return "global" if group.window is None else f"window {group.window}"


def render_groups(snap, width: int = 80) -> list[Content]:
    """A model with sliding windows keeps one pool per layer group, of pages of its own size (the pages above
    and the map are the first group's): each group's pages in use and their bytes, then what the windows have
    released from live chats. Nothing for a model with one group."""
    groups = getattr(snap, "groups", ())
    if len(groups) < 2 and all(g.window is None for g in groups):
        return []
    lines = [_kv(_group_name(g), f"{g.used_pages} / {g.num_pages} pg",
                 f"{g.layers} layer{'' if g.layers == 1 else 's'} · {fmt_bytes(g.used_bytes)}", width) for g in groups]
    released = sum(g.released_pages for g in groups)
    lines.append(_kv("released", f"{released} pages", f"{fmt_bytes(snap.window_released_bytes)} by windows", width))
    return lines


def render_map(snap, chats: list[ChatPages], width: int, rows: int = MAP_ROWS) -> Content:
    """One cell per page, coloured by owner, in at most `rows` rows: past that, each cell stands for a group of
    pages (the title says how many). rows=1 is the folded map: that one row, without legend or CPU tier."""
    live, idle = _owners(snap, chats)
    n = len(snap.page_states)
    width = max(8, width)
    group = max(1, -(-n // (width * max(1, rows))))
    cells = [_cell(snap, range(start, min(n, start + group)), live, idle) for start in range(0, n, group)]
    lines = [_join_runs(cells[r:r + width]) for r in range(0, len(cells), width)]
    groups = getattr(snap, "groups", ())
    title = "Page map" + (f" · {_group_name(groups[0])} layers" if len(groups) > 1 else "") + (
        f"  (1 cell = {group} pages)" if group > 1 else "")
    if rows <= 1:
        return Content("\n").join([_heading(title), *lines])
    legend = Content.assemble(
        (GLYPH_USED, "$foreground"), " used  ", (GLYPH_SHARED, "$foreground"), " shared  ",
        (GLYPH_CACHED, "$foreground"), " cached  ", (GLYPH_FREE, MUTED), " free")
    out = [_heading(title), *lines, legend]
    if snap.cpu_total:
        cpu = ([(GLYPH_USED, "$warning")] * snap.cpu_swapped + [(GLYPH_CACHED, "$warning")] * snap.cpu_cached
               + [(GLYPH_FREE, MUTED)] * max(0, snap.cpu_total - snap.cpu_used))
        cpu = cpu[:width * 4]
        out.append(Content.styled("CPU tier (swapped █, offloaded ░)", MUTED))
        out += [_join_runs(cpu[r:r + width]) for r in range(0, len(cpu), width)]
    return Content("\n").join(out)


def _cell(snap, pages: range, live: dict, idle: dict) -> tuple[str, str]:
    """The glyph and style of one map cell; a group shows its busiest page."""
    states = snap.page_states
    best = None
    for p in pages:
        if states[p] == USED:
            best = p
            if snap.ref_counts.get(p, 0) > 1:
                break
        elif states[p] == CACHED and (best is None or states[best] == FREE):
            best = p
        elif best is None:
            best = p
    p = best
    state = states[p]
    if state == USED:
        owner = live.get(p)
        colour = owner.colour if owner else "$foreground"
        shared = snap.ref_counts.get(p, 0) > 1
        return (GLYPH_SHARED if shared else GLYPH_USED), (f"bold {colour}" if shared else colour)
    if state == CACHED:
        owner = idle.get(p)
        return GLYPH_CACHED, (owner.colour if owner else MUTED)
    return GLYPH_FREE, MUTED


def _join_runs(cells: list[tuple[str, str]]) -> Content:
    """Cells to one Content line, merging runs of one style so a big map stays a handful of spans."""
    parts: list[tuple[str, str]] = []
    for glyph, style in cells:
        if parts and parts[-1][1] == style:
            parts[-1] = (parts[-1][0] + glyph, style)
        else:
            parts.append((glyph, style))
    return Content.assemble(*parts)


def chat_status(snap, chat: ChatPages) -> tuple[str, list[int], int]:
    """(status, pages, tokens) of a chat: its live sequence if it has one, else what it last held."""
    seq = snap.seqs.get(chat.request_id) if chat.request_id else None
    if seq is not None:
        return seq.status, list(seq.pages), seq.num_tokens
    if chat.request_id:
        return "queued", [], 0
    return "idle", list(chat.pages), chat.tokens


def render_chats(snap, chats: list[ChatPages], width: int = 80) -> Content:
    lines = [_heading("Chats")]
    if not chats:
        lines.append(Content.styled("no chats", MUTED))
    title_w = max(5, min(20, width - 30))  # the marker, status and figures take 27 cells, a note 3 more
    for chat in chats:
        status, pages, tokens = chat_status(snap, chat)
        notes = ""
        shared = sum(1 for p in pages if snap.ref_counts.get(p, 0) > 1)
        if shared and status != "idle":
            notes += f" {GLYPH_SHARED}{shared}"
        seq = snap.seqs.get(chat.request_id) if chat.request_id else None
        if seq is not None and seq.cpu_pages:
            notes += f" cpu {seq.cpu_pages}"
        style = "$warning" if status in ("swapped", "waiting", "queued") else (
            "$success" if status == "running" else MUTED)
        lines.append(Content.assemble(
            (GLYPH_USED, chat.colour), " ", (f"{_clip(chat.title, title_w):<{title_w}}", "bold"), " ",
            (f"{status:<7}", style), f"{tokens:>6} tok{len(held(pages)):>4} pg", (notes, "$accent")))
    return Content("\n").join(lines)


def held(pages: list[int]) -> list[int]:
    """A block table's pages, without the entries a sliding window released."""
    return [p for p in pages if p != NULL_PAGE]


def render_sharing(snap, width: int = 80, folded: bool = False) -> Content:
    """What sharing saves, the slack a contiguous cache would waste, and the cache's counters; folded: the
    heading and one line of the figures that matter most."""
    c = snap.counters
    saved = snap.pages_saved_by_sharing
    live = len(snap.seqs)
    shared = len(snap.shared_pages)
    if folded:
        return Content.assemble(_heading("Sharing and waste"), "\n", Content.styled(
            f"shared {shared} · saves {saved} pg · hits {snap.hit_rate:.0%}", MUTED))
    lines = [_heading("Sharing and waste"),
             _kv("shared", f"{shared} page{'' if shared == 1 else 's'}",
                 f"saves {saved} ({fmt_bytes(saved * snap.page_bytes)})", width)]
    if live:
        slack = sum(len(s.pages) * snap.block_size - s.num_tokens for s in snap.seqs.values() if s.pages)
        live_pages = {p for s in snap.seqs.values() for p in held(s.pages)}
        paged = len(live_pages) * snap.page_bytes
        avoided = 1 - paged / snap.contiguous_bytes if snap.contiguous_bytes else 0.0
        lines += [_kv("contiguous", fmt_bytes(snap.contiguous_bytes), f"{live} × full context", width),
                  _kv("paged", fmt_bytes(paged), f"{avoided:.0%} less", width),
                  _kv("slack", f"{max(0, slack)} slots", "in last pages", width)]
    else:
        lines.append(_kv("contiguous", "—", "no live requests", width))
    lines += [
        _kv("prefix hits", f"{snap.hit_rate:.0%}",
            f"recent {snap.recent_hit_rate:.0%} · {c.prefix_hits}/{c.prefix_queries}", width),
        _kv("swaps", f"out {c.swap_outs} · in {c.swap_ins}",
            f"recompute {c.recomputes}", width),
        _kv("evictions", str(c.evictions),
            f"offload {c.offloads} · CoW {c.cow_copies}", width),
    ]
    if c.drafted:  # speculative decoding's drafts (docs/speculative.md)
        lines.append(_kv("drafts", f"{c.accepted / c.drafted:.0%} kept", f"{c.accepted}/{c.drafted}", width))
    return Content("\n").join(lines)


def render_block_table(snap, chat: ChatPages | None) -> Content:
    if chat is None:
        return Content.assemble(_heading("Block table"), "\n", Content.styled("no chat in focus", MUTED))
    status, pages, tokens = chat_status(snap, chat)
    head = Content.assemble(_heading("Block table  "), (GLYPH_USED, chat.colour), " ", (_clip(chat.title, 22), "bold"),
                            "\n", Content.styled(f"{status} · {tokens} tokens · {len(pages)} pages", MUTED))
    if not pages:
        note = "no pages yet" if status != "idle" else "no pages: send a message"
        return Content.assemble(head, "\n", Content.styled(note, MUTED))
    rows = [head, Content.styled(" blk   page  fill   ref", MUTED)]
    bs = snap.block_size
    shown = list(range(len(pages)))
    if len(shown) > MAX_TABLE_ROWS:
        half = MAX_TABLE_ROWS // 2
        shown = shown[:half] + [-1] + shown[-half:]
    for i in shown:
        if i < 0:
            rows.append(Content.styled(f"  … {len(pages) - 2 * (MAX_TABLE_ROWS // 2)} more blocks …", MUTED))
            continue
        page = pages[i]
        fill = max(0, min(bs, tokens - i * bs))
        if page == NULL_PAGE:
            rows.append(Content.assemble(f"{i:>4} → ", ("    —", MUTED), f"  {fill:>2}/{bs:<3}",
                                         ("    released by the window", MUTED)))
            continue
        ref = snap.ref_counts.get(page, 0)
        state = snap.page_states[page] if page < len(snap.page_states) else FREE
        mark: tuple[str, str] = ("", "")
        if ref > 1:
            mark = ("◆ CoW" if fill < bs else "◆ shared", "$accent")
        elif status == "idle":
            mark = {CACHED: ("░ cached", MUTED), USED: ("reused", "$warning"),
                    FREE: ("freed", MUTED)}[state]
        rows.append(Content.assemble(f"{i:>4} → ", (f"{page:>5}", chat.colour), f"  {fill:>2}/{bs:<3}",
                                     f" {ref:>2} ", mark))
    return Content("\n").join(rows)


def fitted_parts(snap, chats: list[ChatPages], width: int, height: int) -> tuple[Content, ...]:
    """The summary, the map, the sharing and the chats, made to leave the block table's heading in a panel
    `height` rows tall (each part is followed by a blank row): the map in fewer rows (each cell then more pages),
    and where even its smallest does not fit, the map and the sharing folded to a line each."""
    summary, chats_part = render_summary(snap, width), render_chats(snap, chats, width)
    sharing = render_sharing(snap, width)
    spare = height - sum(_height(p) + 1 for p in (summary, sharing, chats_part)) - 1
    for rows in range(MAP_ROWS, 1, -1):
        page_map = render_map(snap, chats, width, rows)
        if _height(page_map) + 1 <= spare:
            return summary, page_map, sharing, chats_part
    return summary, render_map(snap, chats, width, rows=1), render_sharing(snap, width, folded=True), chats_part


def _height(content: Content) -> int:
    return content.plain.count("\n") + 1


class InspectorView(VerticalScroll):
    """The F2 side panel. update_view() re-renders only when the picture changed."""

    DEFAULT_CSS = """
    InspectorView > Static { margin-bottom: 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._last_key = None
        self.last_snapshot = None

    def compose(self) -> ComposeResult:
        yield Static(Content.styled("loading the model…", MUTED), id="insp-summary")
        yield Static(id="insp-map")
        yield Static(id="insp-sharing")
        yield Static(id="insp-chats")
        yield Static(id="insp-table")
        remote = Static(id="insp-remote")  # shown instead of the five above for a server without a page map
        remote.display = False
        yield remote

    def map_width(self) -> int:
        # The content region, less a column for the scrollbar that appears once the panel overflows.
        return max(8, self.scrollable_content_region.width - (0 if self.show_vertical_scrollbar else 1))

    def update_view(self, view, chats: list[ChatPages], focused: ChatPages | None, force: bool = False) -> None:
        """Draw a backend's memory view: a snapshot's full page map, or what a server without one tells."""
        width, height = self.map_width(), self.scrollable_content_region.height
        key = (view, tuple(chats), focused, width, height)
        if not force and key == self._last_key:
            return
        self._last_key = key
        if not has_page_map(view):
            self._show_parts(render_without_map(view, chats, width))
            return
        snap = self.last_snapshot = view
        self._show_parts(())
        parts = fitted_parts(snap, chats, width, height)
        for part, content in zip(("#insp-summary", "#insp-map", "#insp-sharing", "#insp-chats"), parts):
            self.query_one(part, Static).update(content)
        self.query_one("#insp-table", Static).update(render_block_table(snap, focused))

    def _show_parts(self, parts: tuple[Content, ...]) -> None:
        """parts: what a view without a page map shows, in place of the summary and the chats; () for a map."""
        self.query_one("#insp-remote", Static).display = bool(parts)
        for part in ("#insp-summary", "#insp-map", "#insp-sharing", "#insp-chats", "#insp-table"):
            self.query_one(part, Static).display = not parts
        if parts:
            self.query_one("#insp-remote", Static).update(Content("\n\n").join(parts))

    def show_message(self, text: str) -> None:
        self._last_key = None
        self._show_parts(())
        self.query_one("#insp-summary", Static).update(Content.styled(visible_controls(text), MUTED))
