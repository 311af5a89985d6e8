"""pagedchat.text: terminal controls made visible, markup escaped, for every place that shows text."""

import unicodedata

from hypothesis import given
from hypothesis import strategies as st
from textual.content import Content

from pagedchat.text import escaped_markup, plain, visible_controls

C0 = [chr(c) for c in range(0x20) if chr(c) not in "\t\n\r"]


def test_each_control_becomes_a_picture():
    assert visible_controls("\x1b]2;title\x07") == "␛]2;title␇"                      # OSC 2: window title
    assert visible_controls("\x1b]52;c;aGk=\x1b\\") == "␛]52;c;aGk=␛\\"              # OSC 52: clipboard
    assert visible_controls("\x1b]8;;https://x\x1b\\a\x1b]8;;\x1b\\") == "␛]8;;https://x␛\\a␛]8;;␛\\"  # OSC 8
    assert visible_controls("\x1b[31mred\x1b[0m") == "␛[31mred␛[0m"                  # CSI
    assert visible_controls("\x9b2J \x9d0;t\x9c") == "␛[2J ␛]0;t␛\\"                  # C1 CSI, OSC, ST
    assert visible_controls("\x00\x08\x7f") == "␀␈␡"
    for c in C0:
        assert unicodedata.name(visible_controls(c)).startswith("SYMBOL FOR")


def test_text_tab_newline_and_unicode_are_untouched():
    text = "Grüße\tmañana\n日本語 — ✓ 🙂 [b]x[/b] \\[ ␛ already a picture"
    assert visible_controls(text) == text


def test_bidi_overrides_and_isolates_show_as_their_code_points():
    # U+202E would make "gnp.exe" read "exe.png" on the terminal.
    assert visible_controls("photo\u202egnp.exe") == "photo⟨U+202E⟩gnp.exe"
    bidi = [chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]]
    shown = visible_controls("".join(bidi))
    assert not set(shown) & set(bidi) and shown.count("⟨U+") == len(bidi)
    assert visible_controls("עברית العربية") == "עברית العربية"   # right-to-left text itself is untouched


def test_carriage_returns_are_dropped():
    assert visible_controls("one\r\ntwo\rover") == "one\ntwoover"


@given(st.text())
def test_no_control_survives_and_chunks_do_not_matter(text):
    shown = visible_controls(text)
    assert not any(unicodedata.category(c) == "Cc" and c not in "\t\n" for c in shown)
    reordering = ("LRE", "RLE", "PDF", "LRO", "RLO", "LRI", "RLI", "FSI", "PDI")
    assert not any(unicodedata.bidirectional(c) in reordering for c in shown)
    cut = len(text) // 2
    assert visible_controls(text[:cut]) + visible_controls(text[cut:]) == shown


@given(st.text(alphabet="[]\\/@=$#:ab .()'\"\x1b", max_size=40))
def test_escaped_markup_round_trips_through_textual(text):
    assert Content.from_markup(escaped_markup(text)).plain == visible_controls(text)


def test_plain_is_never_markup():
    for text in ["[/] [bold]x", "[link=https://example.com]click[/link]", "[@click=app.quit]quit", "[b][/b",
                 "\\[bold]", "unbalanced ["]:
        assert plain(text).plain == text and not plain(text).spans
