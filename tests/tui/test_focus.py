"""Where the keyboard goes: each dialog opens on its first field, Tab leaves a multi-line field, and hiding the
memory inspector (F2) gives focus back to where it was, so typing and Esc work again (issue 21, item 8)."""

from __future__ import annotations

from textual import events
from textual.widgets import Input, TextArea

from pagedchat.tui.chat_widgets import PromptInput
from pagedchat.tui.inspector import InspectorView
from pagedchat.tui.screens.modals import ChatSettingsScreen, EditMessageScreen
from tui_support import chat_once, quick_pilot, scripted_app, wait_for  # noqa: F401 (autouse)

SIZE = (110, 36)


async def opened(pilot, screen_type, field: str):
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, screen_type) and app.screen.query(field), "the dialog")
    await pilot.pause()
    return app.screen.query_one(field)


async def test_settings_open_on_the_system_prompt_and_tab_leaves_it(tmp_path):
    app = scripted_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        await pilot.press("f3")
        system = await opened(pilot, ChatSettingsScreen, "#system")
        assert app.focused is system
        await pilot.press("B", "e", "tab")
        assert system.text.startswith("Be") and isinstance(app.focused, Input) and app.focused.id == "max_tokens"
        await pilot.press("shift+tab")
        assert app.focused is system


async def test_the_edit_dialog_opens_on_its_text(tmp_path):
    app = scripted_app(tmp_path, ["answer"])
    async with app.run_test(size=SIZE) as pilot:
        await chat_once(pilot, "question")
        await pilot.press("alt+up", "up", "e")
        text = await opened(pilot, EditMessageScreen, "#text")
        assert app.focused is text and isinstance(text, TextArea)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, EditMessageScreen), "the dialog to close")
        assert isinstance(app.focused, PromptInput)   # and the walk is over


async def test_hiding_the_inspector_gives_focus_back_and_esc_stops_the_reply(tmp_path):
    app = scripted_app(tmp_path, ["a long answer " * 400], chunks=500)   # streams for ten seconds
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        prompt = app.active_chat.prompt
        prompt.focus()
        prompt.text = "tell me a story"
        await pilot.press("enter")
        session = app.active_session
        await wait_for(pilot, lambda: session.reply.tokens > 0, "the reply to stream")
        await pilot.press("f2")
        inspector = app.query_one(InspectorView)
        assert inspector.display and app.focused is prompt
        await pilot.press("tab")   # into the inspector, to scroll it
        assert app.focused is not prompt and inspector in (app.focused, *app.focused.ancestors)
        await pilot.press("f2")
        assert not inspector.display and app.focused is prompt
        await pilot.press(*"still typing")
        assert prompt.text == "still typing"
        await pilot.press("escape")
        await wait_for(pilot, lambda: not session.busy, "Esc to stop the reply")
        assert session.record.messages[-1].stats.finish_reason == "cancelled"


async def test_the_chats_keys_work_with_the_keyboard_in_the_inspector(tmp_path):
    """F3 and F4 act on the chat in view wherever the keyboard is on its screen, as ctrl+n does."""
    app = scripted_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        await pilot.press("f2", "tab")   # into the inspector
        inspector = app.query_one(InspectorView)
        assert inspector in (app.focused, *app.focused.ancestors)
        await pilot.press("f3")
        await opened(pilot, ChatSettingsScreen, "#system")


async def test_enter_sends_from_the_input_only(tmp_path):
    """Enter on a message (the walk) sends nothing: the text in the input stays there, unsent."""
    app = scripted_app(tmp_path, ["answer", "second answer"])
    async with app.run_test(size=SIZE) as pilot:
        session = await chat_once(pilot, "question")
        prompt = app.active_chat.prompt
        prompt.text = "a draft"
        await pilot.press("alt+up", "enter")
        await pilot.pause()
        assert len(session.record.messages) == 2 and not session.busy and prompt.text == "a draft"
        await pilot.press("escape")   # back to the input, where Enter sends
        assert app.focused is prompt
        await pilot.press("enter")
        await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == 4, "the second reply")
        assert session.record.messages[2].content == "a draft" and prompt.text == ""


async def test_a_burst_of_keys_ending_in_enter_is_sent_whole(tmp_path):
    """Keys that arrive at once (a fast typist, a terminal multiplexer): Enter sends after every key before it
    has reached the input, not the text as it stood when Enter arrived."""
    app = scripted_app(tmp_path, ["ok"])
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        session = app.active_session
        for key in [*"hello", "enter"]:
            app.post_message(events.Key(key, "\r" if key == "enter" else key))
        await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == 2, "the reply")
        assert session.record.messages[0].content == "hello" and app.active_chat.prompt.text == ""
