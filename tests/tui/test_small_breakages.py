"""Smaller breakages seen in the real app (issue 21, item 9), each driven as a user meets it."""

from __future__ import annotations

from pagedchat.tui.chat_ops import export_chat
from pagedchat.tui.chat_widgets import MessageView
from pagedchat.tui.transfer import ExportFormat
from tui_support import chat_once, notices, quick_pilot, scripted_app, wait_for  # noqa: F401 (autouse)

SIZE = (110, 36)
CUT_IN_A_BLOCK = "Here is the code:\n\n```python\ndef add(a, b):\n    return a + b"


async def test_a_reply_cut_inside_a_code_block_exports_closed_and_k_copies_the_block(tmp_path):
    app = scripted_app(tmp_path, [CUT_IN_A_BLOCK])
    copied: list[str] = []
    app.copy_to_clipboard = copied.append
    async with app.run_test(size=SIZE) as pilot:
        session = await chat_once(pilot, "write add()")
        await pilot.press("alt+up")
        assert isinstance(app.focused, MessageView) and app.focused.index == 1
        await pilot.press("k")
        await wait_for(pilot, lambda: copied, "the copy")
        assert copied == ["def add(a, b):\n    return a + b"]
        path = export_chat(app, session, ExportFormat.MARKDOWN)
        text = path.read_text()
        assert "    return a + b\n```\n" in text   # the fence is closed before what follows the reply
        assert text.count("```") == 2
        assert session.record.messages[-1].content == CUT_IN_A_BLOCK   # the reply itself is kept as written


async def test_ctrl_c_says_how_to_quit_in_plain_words(tmp_path):
    app = scripted_app(tmp_path, ["ok"])
    async with app.run_test(size=SIZE) as pilot:
        await chat_once(pilot, "hi")
        await pilot.press("alt+up", "ctrl+c")   # on a message, not in a text field (there it copies)
        await wait_for(pilot, lambda: any("to quit" in n for n in notices(app)), "the hint")
        hint = next(n for n in notices(app) if "to quit" in n)
        assert hint == "Press ctrl+q to quit the app." and "[" not in hint


async def test_a_line_too_long_to_wrap_scrolls_sideways_and_short_ones_wrap_again(tmp_path):
    """A 1 MB line was wrapped into some ten thousand rows, each key re-wrapping it and each drawn row re-cutting
    it whole: a key took seconds. Past WRAP_LIMIT characters the line stays one row."""
    app = scripted_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.active_chat is not None, "the chat")
        prompt = app.active_chat.prompt
        prompt.focus()
        prompt.text = "x" * 1_000_000
        prompt.move_cursor(prompt.document.end)
        await pilot.press("y")
        await wait_for(pilot, lambda: prompt.wrapped_document.height == 1, "the line to stay one row")
        assert prompt.text.endswith("xy") and prompt.scroll_offset.x > 0   # scrolled to the cursor
        prompt.text = "short words " * 30
        await wait_for(pilot, lambda: prompt.wrapped_document.height > 1, "a short text to wrap again")
