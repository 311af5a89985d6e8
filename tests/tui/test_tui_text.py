"""Text is text: user and model text with markup or terminal escapes, through every place the app shows it.

The engine is the scripted stand-in (tui_support.ScriptedEngine): these tests need exact model output.
"""

from __future__ import annotations

import re

import pytest
from textual.widgets import OptionList, TextArea

from pagedchat.text import visible_controls
from pagedchat.tui.chat_ops import export_chat, pick_message
from pagedchat.tui.conversation import title_from
from pagedchat.tui.screens.modals import ChatSettingsScreen, EditMessageScreen, PickScreen
from pagedchat.tui.store import Store
from pagedchat.tui.screens.ask import ConfirmScreen, RenameScreen
from pagedchat.tui.transfer import ExportFormat
from tui_support import (chat_once, notices, quick_pilot, screen_text, scripted_app, static_text,  # noqa: F401
                         wait_for)

SIZE = (120, 36)
MARKUP = ["[/] [bold]x", "[link=https://example.com]click[/link]", "[@click=app.quit]quit", "unbalanced [b",
          "\\[bold]not bold", "[b][/b"]
# Each would act on a terminal that received it raw: window title, clipboard write, hyperlink, colour, C1 CSI
# (clear screen), bell, NUL, backspace, carriage return, DEL.
ESCAPES = ("title\x1b]2;pwned\x07 clip\x1b]52;c;cHduZWQ=\x07 link\x1b]8;;https://evil.example\x1b\\here"
           "\x1b]8;;\x1b\\ colour\x1b[31mred\x1b[0m c1\x9b2J bell\x07 nul\x00 bs\x08 cr\rX del\x7f end")
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


async def shows(pilot, screen_type, what: str):
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, screen_type), what)
    await pilot.pause()
    return screen_text(pilot.app)


def toasts(app) -> str:
    """The text of the notifications on screen, each on one line (a toast wraps long messages)."""
    return "\n".join(" ".join(str(t.render()).split()) for t in app.screen.query("Toast"))


def raw_controls(text: str) -> list[str]:
    return sorted(set(CONTROLS.findall(text)))


async def open_palette_entry(pilot, query: str) -> str:
    """The command palette's text after typing query into it."""
    app = pilot.app
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: app.screen.__class__.__name__ == "CommandPalette", "the palette")
    await pilot.press(*query)
    await pilot.pause(0.3)
    text = screen_text(app)
    await pilot.press("escape")
    return text


@pytest.mark.slow  # six payloads through every dialog: the escape test runs text through them too
async def test_markup_in_a_chat_is_shown_literally_everywhere(tmp_path):
    replies = []
    for payload in MARKUP:
        replies += [f"{payload}\n\n```\n{payload} one\n```\n\n```\n{payload} two\n```\n", ("", f"{payload} failed")]
    app = scripted_app(tmp_path, replies)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        for payload in MARKUP:   # one chat each, in one app: a crash ends the app, and the test, at that payload
            await check_markup_payload(pilot, payload)


async def check_markup_payload(pilot, payload: str) -> None:
    app = pilot.app
    if app.active_session.record.messages:
        await pilot.press("ctrl+n")
    session = await chat_once(pilot, payload)
    title = title_from(payload)
    assert session.record.title == title
    assert app.tabs.get_tab("chat-" + session.id).label.plain.startswith(f"■ {title}")

    await pilot.press("f3")
    assert f"Settings — {title}" in await shows(pilot, ChatSettingsScreen, "F3")
    await pilot.press("escape")

    await pilot.press("f4")
    await shows(pilot, RenameScreen, "F4")
    assert app.screen.query_one("#title").value == title
    await pilot.press("escape")

    pick_message(app, "Edit which message?", app.active_chat.edit_message, role="user")
    assert f"1. You: {title_from(payload, 50)}" in await shows(pilot, PickScreen, "the message picker")
    await pilot.press("enter")
    await shows(pilot, EditMessageScreen, "the edit dialog")
    assert app.screen.query_one(TextArea).text == payload
    await pilot.press("escape")

    app.chat_view(session).view_at(1).focus()
    await pilot.press("k")
    picked = await shows(pilot, PickScreen, "the code block picker")
    assert f"{payload} one" in picked and f"{payload} two" in picked
    assert [str(o.prompt) for o in app.screen.query_one(OptionList).options] == [f"{payload} one",
                                                                                 f"{payload} two"]
    await pilot.press("escape")

    await pilot.press("ctrl+r")   # the scripted engine fails this one: its error shows in a notification
    await wait_for(pilot, lambda: any(f"{payload} failed" in n for n in notices(app)),
                   "the failure notice")
    await pilot.pause()
    assert f"The reply failed: {payload} failed" in toasts(app)

    await pilot.press("f8")   # the delete confirmation names the chat; n keeps it
    assert f"Delete “{title}” for good?" in await shows(pilot, ConfirmScreen, "the delete question")
    await pilot.press("n")
    await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmScreen), "the question to close")

    await pilot.press("ctrl+w")
    await wait_for(pilot, lambda: session.id not in app.sessions, "the chat to close")
    await pilot.pause()
    assert f"Closed “{title}”" in toasts(app)
    assert f"Reopen chat: {title}" in await open_palette_entry(pilot, "reopen")
    app.clear_notifications()


async def test_escape_sequences_never_reach_the_terminal(tmp_path):
    user_text = "say \x1b]2;user-title\x07 hi \x1b[5m"
    app = scripted_app(tmp_path, [ESCAPES, (ESCAPES[:20], f"boom {ESCAPES}")])
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        session = await chat_once(pilot, user_text)
        # Stored exactly as written; shown with the controls as pictures.
        assert [m.content for m in session.record.messages] == [user_text, ESCAPES]
        main = screen_text(app)
        assert raw_controls(main) == []
        assert "␛]2;pwned␇" in main and "␛]2;user-title␇" in main and "␛[2J" in main

        await pilot.press("f2")
        await pilot.pause(0.3)
        assert raw_controls(screen_text(app)) == []
        assert "say ␛]2;user-title" in screen_text(app)  # the inspector's chat list
        await pilot.press("f2")

        for key, screen in (("f3", ChatSettingsScreen), ("f4", RenameScreen)):
            await pilot.press(key)
            assert raw_controls(await shows(pilot, screen, key)) == []
            await pilot.press("escape")

        pick_message(app, "Edit which message?", app.active_chat.edit_message, role="user")
        assert raw_controls(await shows(pilot, PickScreen, "the message picker")) == []
        await pilot.press("enter")
        edit = await shows(pilot, EditMessageScreen, "the edit dialog")
        assert raw_controls(edit) == [] and "␛]2;user-title␇" in edit
        await pilot.press("escape")

        path = export_chat(app, app.active_session, ExportFormat.MARKDOWN)
        exported = path.read_text(encoding="utf-8")
        assert raw_controls(exported) == [] and "␛]52;c;cHduZWQ=␇" in exported

        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: any("boom" in n for n in notices(app)), "the failure notice")
        await pilot.pause()
        assert raw_controls(screen_text(app)) == []
        assert raw_controls(str(app.chat_view(session).view_at(1).query_one(".stats").content)) == []

        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: session.id not in app.sessions, "the chat to close")
        await pilot.pause()
        assert raw_controls(screen_text(app)) == []
        assert raw_controls(await open_palette_entry(pilot, "reopen")) == []
    [saved] = [r for r in Store.open(tmp_path / "data").load_chats(open_only=False) if r.id == session.id]
    assert saved.messages[0].content == user_text


async def test_an_unchanged_dialog_keeps_the_exact_text(tmp_path):
    """The edit and settings dialogs show controls as pictures; saving without a change keeps the original."""
    system = "be \x1b[1mbold\x1b[0m"
    app = scripted_app(tmp_path, ["first", "second"])
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        session = await chat_once(pilot, "q \x1b]2;t\x07")
        session.record.system_prompt = system
        await pilot.press("f3")
        await shows(pilot, ChatSettingsScreen, "F3")
        assert app.screen.query_one("#system", TextArea).text == visible_controls(system)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen), "F3 to close")
        assert session.record.system_prompt == system

        app.active_chat.edit_message(0)
        await shows(pilot, EditMessageScreen, "the edit dialog")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not session.busy and session.record.messages[-1].content == "second",
                       "the resent reply")
        assert session.record.messages[0].content == "q \x1b]2;t\x07"


async def test_a_stopped_engines_reason_is_shown_as_text(tmp_path):
    reason = "[/] RuntimeError: shape [1, 2] \x1b]2;pwned\x07"
    app = scripted_app(tmp_path, ["hi"])
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await chat_once(pilot, "hello")
        app.backend.engine.failure = reason  # the stand-in engine stops, as Engine sets failure
        await wait_for(pilot, lambda: "engine stopped" in static_text(app, "#status"), "the status line")
        assert static_text(app, "#status") == f"engine stopped: {visible_controls(reason)}"
        await pilot.pause()
        assert f"engine stopped: {visible_controls(reason)}. Restart it" in toasts(app)
        assert raw_controls(screen_text(app)) == []
        palette = await open_palette_entry(pilot, "restart")
        assert f"The engine stopped ({visible_controls(reason)}); load it again" in palette
