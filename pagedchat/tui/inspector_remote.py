"""The inspector for a server that shows no page map: vLLM's server-wide figures, or a line saying why not.

Pure functions of (view, chats, width), like inspector.py's renderers. vLLM counts everything over all its
clients and names no request's pages, so this view says "server-wide", and a chat's pages are an estimate
(its tokens over the page size) marked with "~".
"""

from __future__ import annotations

from textual.content import Content

from pagedchat.backends.base import MemoryUnavailable
from pagedchat.backends.remote_metrics import ServerMetrics
from pagedchat.tui.inspector_parts import GLYPH_USED, MUTED, ChatPages, clip, heading, kv

SOURCES = {"vllm": "vLLM /metrics", "pagedchat": "pagedchat /metrics"}


def _bar(fraction: float, width: int) -> Content:
    bar_w = max(8, min(24, width - 10))
    filled = round(fraction * bar_w)
    return Content.assemble(Content.styled("█" * filled, "$accent"), Content.styled("░" * (bar_w - filled), MUTED),
                            f" {fraction:4.0%} used")


def _count(n: int | None) -> str:
    return "?" if n is None else str(n)


def render_server(m: ServerMetrics, width: int = 80) -> Content:
    lines = [heading("KV cache, server-wide"),
             Content.styled(f"from {SOURCES.get(m.source, m.source)}: every client of this server", MUTED)]
    if m.kv_usage is not None:
        lines.append(_bar(m.kv_usage, width))
    if m.num_pages is not None:
        used = m.used_pages
        lines.append(kv("pages", Content.styled(f"~{used} / {m.num_pages}" if used is not None else f"{m.num_pages}",
                                                 "bold"), "in use (from usage)" if used is not None else "", width))
    if m.block_size is not None:
        lines.append(kv("page", f"{m.block_size} tokens", width=width))
    if m.hit_rate is not None:
        lines.append(kv("prefix hits", f"{m.hit_rate:.0%}", f"{m.prefix_hits:.0f} of {m.prefix_queries:.0f} tokens",
                         width))
    lines.append(kv("requests", f"{_count(m.running)} running · {_count(m.waiting)} waiting", width=width))
    if m.preemptions is not None:
        lines.append(kv("preemptions", str(m.preemptions), width=width))
    return Content("\n").join(lines)


def render_estimated_chats(m: ServerMetrics, chats: list[ChatPages], width: int = 80) -> Content:
    """Each chat's tokens (its last finished exchange) and, with a known page size, its pages estimated."""
    bs = m.block_size
    lines = [heading("Chats"), Content.styled(f"pages estimated: tokens / {bs}" if bs else
                                               "the server gives no page size: tokens only", MUTED)]
    if not chats:
        lines.append(Content.styled("no chats", MUTED))
    title_w = max(5, min(20, width - 30))
    for chat in chats:
        running = chat.request_id is not None
        tokens = f"≥{chat.tokens}" if running and chat.tokens else (str(chat.tokens) if chat.tokens else "…")
        pages = f"~{-(-chat.tokens // bs)} pg" if bs and chat.tokens else ""
        lines.append(Content.assemble(
            (GLYPH_USED, chat.colour), " ", (f"{clip(chat.title, title_w):<{title_w}}", "bold"), " ",
            (f"{'running' if running else 'idle':<7}", "$success" if running else MUTED),
            f"{tokens:>7} tok {pages:>7}"))
    return Content("\n").join(lines)


def render_unavailable(view: MemoryUnavailable) -> Content:
    return Content.assemble(heading("KV cache"), "\n", Content.styled(view.reason, MUTED))


def render_without_map(view, chats: list[ChatPages], width: int = 80) -> tuple[Content, ...]:
    """The inspector's parts for a ServerMetrics or a MemoryUnavailable view."""
    if isinstance(view, ServerMetrics):
        return render_server(view, width), render_estimated_chats(view, chats, width)
    return (render_unavailable(view),)
