"""Text from users and models, made safe to show: one rule for every place that puts it on a terminal.

A model's bytes can hold terminal controls: ESC opens CSI/OSC sequences that recolour the screen, set the
window title (OSC 2), write the clipboard (OSC 52) or make links (OSC 8). A byte-level tokenizer emits ESC as
readily as any letter. Textual passes such characters through to the terminal, so every display path sends
text through `visible_controls` first; the stored text keeps exactly what was written.

Controls are shown, not dropped, so that nothing the model wrote disappears without a trace: C0 controls and
DEL become their Unicode control pictures (ESC is "␛"), a C1 control becomes "␛" and its 7-bit equivalent
(U+009B, the one-byte CSI, shows as "␛["); a bidi override or isolate shows as its code point ("⟨U+202E⟩").
Tab and newline stay; a carriage return is dropped, since a CRLF line
end is common and a lone one only serves to overwrite what came before it on the line.

Character by character, so a stream cut into chunks anywhere gives the same result as the whole text.

`plain` and `escaped_markup` are for Textual: `plain` for APIs that take a Content, `escaped_markup` for the
few that insist on parsing a string as markup (the command palette).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textual.content import Content

_KEEP = {"\t", "\n"}
_DROP = {"\r"}
_CONTROL_PICTURES = 0x2400   # U+2400 "␀" ... U+241F "␟": one picture per C0 control, in code order
_DEL_PICTURE = "\u2421"      # "␡"
_ESC_PICTURE = "\u241b"      # "␛"


def _picture(code: int) -> str:
    if code < 0x20:
        return chr(_CONTROL_PICTURES + code)
    if code == 0x7F:
        return _DEL_PICTURE
    return _ESC_PICTURE + chr(code - 0x40)  # C1: ESC followed by the 7-bit form (0x9B -> "␛[")


_TABLE = {code: ("" if chr(code) in _DROP else _picture(code))
          for code in [*range(0x20), *range(0x7F, 0xA0)] if chr(code) not in _KEEP}
# Bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) reorder what follows them on
# the terminal: a right-to-left override makes "exe.txt" read as "txt.exe". They have no control pictures, so
# they show as their code point.
_TABLE.update({code: f"⟨U+{code:04X}⟩" for code in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]})


def visible_controls(text: str) -> str:
    """text with every terminal control made visible (or, for CR, dropped); everything else unchanged."""
    return text.translate(_TABLE)


def plain(text: str) -> Content:
    """User or model text as a Textual Content: never parsed as markup, controls made visible."""
    from textual.content import Content  # here, not at the top: the CLI uses this module and starts without Textual

    return Content(visible_controls(text))


def escaped_markup(text: str) -> str:
    """User or model text for a Textual API that parses markup: brackets escaped, controls made visible.

    Not textual.markup.escape: it leaves "[" before a non-tag character and "\\[" as they are, so "\\[" loses its
    backslash and "[b][/b" raises MarkupError. Textual's parser reads "\\[" as a literal "[" and nothing else,
    so escaping every "[" round-trips any text.
    """
    return visible_controls(text).replace("[", "\\[")
