"""The pieces every inspector view draws with: page states and glyphs, a chat's record, labelled lines."""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content

from pagedchat.engine.records import PageState
from pagedchat.text import visible_controls

FREE, USED, CACHED = PageState.FREE, PageState.USED, PageState.CACHED
GLYPH_USED, GLYPH_SHARED, GLYPH_CACHED, GLYPH_FREE = "█", "◆", "░", "·"
MUTED = "$foreground-muted"


@dataclass(frozen=True)
class ChatPages:
    """What the inspector needs to know about one chat."""

    chat_id: str
    title: str
    colour: str
    request_id: str | None = None   # its live request, if generating
    pages: tuple[int, ...] = ()     # pages its last request held, for idle chats (now cached or reused)
    tokens: int = 0                 # tokens its last request held


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def heading(text: str) -> Content:
    return Content.styled(text, "bold $primary")


KEY_W = 12


def kv(key: str, value: str | Content, note: str = "", width: int = 80) -> Content:
    """`key  value  note`, the note moved under the value when the line would wrap."""
    line = Content.assemble(Content.styled(f"{key:<{KEY_W - 1}} ", MUTED), value)
    if not note:
        return line
    if line.cell_length + 2 + len(note) <= width:
        return Content.assemble(line, Content.styled(f"  {note}", MUTED))
    return Content.assemble(line, "\n", Content.styled(" " * KEY_W + note, MUTED))


def clip(title: str, n: int) -> str:
    """A chat's title in at most n cells, its terminal controls shown as pictures."""
    title = visible_controls(title)
    return title if len(title) <= n else title[:n - 1] + "…"
