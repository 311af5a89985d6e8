"""Where a streaming reply's Markdown can be cut, so that what is above the cut settles into one cheap widget.

Textual's Markdown is a tree of widgets (a list item is five or so), and every screen update lays out the whole
tree: a flush's cost grew with the reply, to a few hundred milliseconds of the main thread at a thousand tokens of
a long list (docs/bench.md#the-app-against-its-engine---app). So a streaming reply keeps only its last few blocks
in its live part (one Static drawn again at each flush); what is above settles into a Static that renders it once
(chat_widgets.MessageView). The cut must leave both parts meaning what they meant together: at the start of a
top-level block, outside a fenced code block and a table, and never where the line could continue the paragraph
above it.
"""

from __future__ import annotations

import re

SETTLE_LINES = 16   # past this many lines, the live Markdown's blocks above its last one settle

# A line that starts a block of its own, even right after a paragraph's line.
_BLOCK_START = re.compile(r"(#{1,6}\s|[-*+]\s|\d{1,9}[.)]\s|>|```|~~~)")
_FENCE = re.compile(r" {0,3}(```|~~~)")
_UNDERLINE = re.compile(r"[=-]+\s*$")   # a setext heading's underline belongs to the line above it


def settle_point(source: str, keep: int = SETTLE_LINES) -> int:
    """The offset of the last safe cut in source, or 0 where there is none or source is not yet longer than
    `keep` lines. Text before the offset renders alone as it did in the whole (the last line, still being
    written, is never cut before)."""
    lines = source.splitlines(keepends=True)
    if len(lines) <= keep:
        return 0
    cut = offset = 0
    fenced = False
    previous = ""
    for line in lines[:-1]:
        starts_block = (not fenced and line[:1] not in ("", " ", "\t", "\n", "|") and not _UNDERLINE.match(line)
                        and (previous.strip() == "" or _BLOCK_START.match(line) is not None)
                        and not previous.lstrip().startswith("|"))
        if starts_block and offset > 0:
            cut = offset
        if _FENCE.match(line):
            fenced = not fenced
        previous = line
        offset += len(line)
    return cut
