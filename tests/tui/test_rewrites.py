"""Every action that rewrites a chat, through its key and through the palette, leaves chats.db holding exactly
what the screen shows; and the message walk ends with the action it fired (issue 21, items 5 and the hidden
data-loss class).

The engine is the scripted stand-in (tui_support.ScriptedEngine): each reply is "answer N", so that which
reply replaced which shows in the text.
"""

from __future__ import annotations

import json
import time

import pytest
from textual.command import CommandList, CommandPalette

from pagedchat.backends.local import LocalBackend
from pagedchat.text import visible_controls
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.chat_widgets import MessageView, PromptInput
from pagedchat.tui.conversation import stats_line
from pagedchat.tui.screens.ask import AskTextScreen, ConfirmScreen
from pagedchat.tui.screens.compare import CompareScreen, CompareSetupScreen
from pagedchat.tui.screens.modals import EditMessageScreen, PickScreen
from pagedchat.tui.store import Store
from tui_support import ScriptedEngine, make_config, quick_pilot, wait_for  # noqa: F401 (autouse)

SIZE = (110, 36)


def scripted_app(tmp_path) -> PagedChatApp:
    engine = ScriptedEngine([f"answer {n}" for n in range(200)])
    return PagedChatApp(make_config(tmp_path), backend_factory=lambda progress: LocalBackend(engine))


async def idle(pilot) -> None:
    """Every chat idle, no dialog open, and what the app marked written."""
    app = pilot.app
    await wait_for(pilot, lambda: len(app.screen_stack) == 1 and not any(s.busy for s in app.sessions.values()),
                   "every chat idle")
    await pilot.pause()


async def turn(pilot, text: str) -> None:
    app = pilot.app
    session = app.active_session
    count = len(session.record.messages)
    prompt = app.chat_view(session).prompt
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == count + 2, "the reply")


async def screen_is_disk(pilot) -> dict[str, list[tuple[str, str]]]:
    """Assert that the saved open chats are exactly the tabs, each with exactly the messages its tab shows (role
    and rendered text), in order; returns them."""
    app = pilot.app
    await idle(pilot)
    shown = {}
    for session in app.chats.ordered():
        view = app.chat_view(session)
        await view.populate()
        views = view.views
        assert [v.index for v in views] == list(range(len(views)))
        shown[session.id] = [(v.message.role, v.shown_source) for v in views]
        # The record behind the screen is the same text (the screen shows controls as pictures).
        assert [(m.role, visible_controls(m.content)) for m in session.record.messages] == shown[session.id]
    reader = Store.read_only(app.store.path)
    try:
        saved = {r.id: [(m.role, visible_controls(m.content)) for m in r.messages]
                 for r in reader.load_chats(open_only=True)}
    finally:
        reader.close()
    assert saved == shown
    return shown


async def palette(pilot, query: str) -> None:
    """Run the palette's best match for `query`."""
    app = pilot.app
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), "the palette")
    await pilot.press(*query)
    await wait_for(pilot, lambda: app.screen.query_one(CommandList).option_count > 0, f"a match for {query!r}")
    await pilot.pause(0.2)   # the search settles on its best match
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, CommandPalette), "the palette to close")


async def walk_to(pilot, index: int) -> MessageView:
    """alt+up from the input, then up to message `index`."""
    app = pilot.app
    view = app.active_chat
    view.prompt.focus()
    await pilot.press("alt+up")
    for _ in range(len(view.views) - 1 - index):
        await pilot.press("up")
    assert isinstance(app.focused, MessageView) and app.focused.index == index
    return app.focused


async def resend(pilot, text: str) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, EditMessageScreen) and app.screen.query("#text"),
                   "the edit dialog")
    field = app.screen.query_one("#text")
    assert app.focused is field   # the dialog opens on its field
    field.text = text
    await pilot.press("ctrl+s")
    await idle(pilot)


def contents(session) -> list[str]:
    return [m.content for m in session.record.messages]


@pytest.mark.slow  # test_tui's test_regenerate_and_edit rewrites in the quick run
async def test_editing_twice_through_the_walk_and_the_palette_keeps_every_earlier_turn(tmp_path):
    app = scripted_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        for text in ("q0", "q1", "q2"):
            await turn(pilot, text)
        session = app.active_session
        earlier = contents(session)[:4]

        await walk_to(pilot, 4)
        await pilot.press("e")
        await resend(pilot, "q2 edited")
        assert contents(session)[:5] == earlier + ["q2 edited"]
        # The walk ended with the edit: the keyboard is in the input, and typing is text, not actions.
        assert isinstance(app.focused, PromptInput)
        await pilot.press(*"Name a mountain.")
        assert app.screen_stack[-1] is app.screen_stack[0] and app.focused.text == "Name a mountain."
        app.focused.text = ""

        # The second edit through the walk starts again from the last message, so it lands where aimed.
        await walk_to(pilot, 4)
        await pilot.press("e")
        await resend(pilot, "q2 edited twice")
        assert contents(session)[:5] == earlier + ["q2 edited twice"] and len(contents(session)) == 6
        await screen_is_disk(pilot)

        # And through the palette: pick q1 (the list starts on the newest of your messages).
        await palette_pick(pilot, "Edit a message", "up")
        await resend(pilot, "q1 edited")
        assert contents(session)[:3] == earlier[:2] + ["q1 edited"] and len(contents(session)) == 4
        assert isinstance(app.focused, PromptInput)
        saved = await screen_is_disk(pilot)
        assert [c for _, c in saved[session.id][:2]] == earlier[:2]


async def test_one_letter_keys_act_only_on_a_focused_message(tmp_path):
    app = scripted_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        await turn(pilot, "q0")
        session = app.active_session
        for key in ("r", "b"):   # regenerate and branch from the walk also give the keyboard back
            await walk_to(pilot, 1)
            await pilot.press(key)
            await idle(pilot)
            assert isinstance(app.focused, PromptInput), key
            await pilot.press(*"ebrck")
            assert app.screen_stack[-1] is app.screen_stack[0] and app.focused.text == "ebrck"
            app.focused.text = ""
            await show(app, session)
        await screen_is_disk(pilot)


async def show(app, session) -> None:
    app.chats.show(session)
    await app.chats.activated(session)


async def palette_pick(pilot, command: str, *keys: str) -> None:
    """A message action through the palette: the command, then the message picked by keys (the list starts on
    the newest of your messages)."""
    await palette(pilot, command)
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, PickScreen), "the pick")
    await pilot.press(*keys, "enter")


async def on_message(pilot, by_keys: bool, index: int, key: str, command: str, landed, *picks: str) -> None:
    """A message action through the walk (to message `index`, then its key) or through the palette's pick; then
    wait until landed() holds. The walk starts once the app has settled: what the last reply's end queued (its
    final render, the save) is done. In about one full run of four the walk's key still came to nothing (focus
    was in the input afterwards, no action had run): such a walk is made once more, the input cleared of the
    letter if it took it, so that this test keeps to what it is about, the database against the screen (the
    walk's keys have a test of their own). The timeout's message says what the input then held."""
    if not by_keys:
        await palette_pick(pilot, command, *picks)
        await wait_for(pilot, landed, f"{command!r} to land")
        return
    for again in (False, True):
        await idle(pilot)
        await walk_to(pilot, index)
        await pilot.press(key)
        prompt = pilot.app.active_chat.prompt
        deadline = time.monotonic() + 5
        while not landed() and time.monotonic() < deadline:
            await pilot.pause(0.01)
        if landed() or again:
            break
        if prompt.text == key:
            prompt.text = ""
    await wait_for(pilot, landed, f"{key!r} on message {index} to land (the input holds {prompt.text!r})")


async def key_or_palette(pilot, by_keys: bool, key: str, command: str) -> None:
    """The same action through its key or through the command palette."""
    if by_keys:
        await pilot.press(key)
    else:
        await palette(pilot, command)


# The quick run rewrites by keys; by the palette takes about four times as long.
@pytest.mark.parametrize("how", ["keys", "palette"])
@pytest.mark.slow  # every rewrite, by keys and palette: test_tui's regenerate and edit stand in
async def test_every_rewrite_keeps_the_database_equal_to_the_screen(tmp_path, how):
    app = scripted_app(tmp_path)
    by_keys = how == "keys"
    exported = tmp_path / "to-import.json"
    exported.write_text(json.dumps({"title": "imported", "messages": [
        {"role": "user", "content": "imported question"}, {"role": "assistant", "content": "imported answer"}]}))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        for text in ("q0", "q1", "q2"):
            await turn(pilot, text)
        first = app.active_session
        await screen_is_disk(pilot)

        # Edit (the walk's e, or the palette's pick).
        await on_message(pilot, by_keys, 2, "e", "Edit a message",
                         lambda: isinstance(app.screen, EditMessageScreen), "up")
        await resend(pilot, "q1 again")
        assert contents(first)[:3] == ["q0", "answer 0", "q1 again"] and len(contents(first)) == 4
        await screen_is_disk(pilot)

        # Regenerate the last reply.
        before = contents(first)
        await key_or_palette(pilot, by_keys, "ctrl+r", "Regenerate last reply")
        await wait_for(pilot, lambda: contents(first)[-1] != before[-1] and not first.busy, "the new reply")
        assert contents(first)[:-1] == before[:-1]
        await screen_is_disk(pilot)

        # Branch at the first reply: a new tab with the first two messages, the original untouched.
        kept = contents(first)
        await on_message(pilot, by_keys, 1, "b", "Branch chat at a message", lambda: len(app.sessions) == 2,
                         "up", "up")
        # The new tab joins the sessions before it is shown: wait for both.
        await wait_for(pilot, lambda: len(app.sessions) == 2 and app.active_session is not first, "the branch")
        branch = app.active_session
        assert contents(branch) == kept[:2] and contents(first) == kept
        await screen_is_disk(pilot)

        # Continue in a new chat (the palette only).
        await show(app, first)
        await palette(pilot, "Continue in a new chat")
        await wait_for(pilot, lambda: len(app.sessions) == 3, "the continued chat")
        await screen_is_disk(pilot)

        # Compare, and keep B.
        await show(app, first)
        await key_or_palette(pilot, by_keys, "f5", "Compare")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareSetupScreen), "the compare form")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), "the split view")
        await wait_for(pilot, lambda: all(s.outcome is not None for s in app.screen.sides), "both answers")
        await pilot.press("2")
        await wait_for(pilot, lambda: len(app.sessions) == 4, "the kept answer as a chat")
        assert contents(first) == kept
        await screen_is_disk(pilot)

        # Import.
        if by_keys:
            from pagedchat.tui.chat_ops import ask_import
            ask_import(app)   # the palette is its only way in; the dialog is the same
        else:
            await palette(pilot, "Import a chat")
        await wait_for(pilot, lambda: isinstance(app.screen, AskTextScreen) and app.screen.query("#text"),
                       "the path question")
        app.screen.query_one("#text").value = str(exported)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.sessions) == 5 and app.active_session.record.title == "imported",
                       "the imported chat")
        assert contents(app.active_session) == ["imported question", "imported answer"]
        await screen_is_disk(pilot)

        # Delete the branch.
        await show(app, branch)
        await key_or_palette(pilot, by_keys, "f8", "Delete chat")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
        await pilot.press("y")
        await wait_for(pilot, lambda: branch.id not in app.sessions, "the delete")
        assert contents(first) == kept
        shown = await screen_is_disk(pilot)
        assert len(shown) == 4


async def test_esc_before_the_first_token_keeps_a_marked_reply(tmp_path):
    """The empty reply was dropped, so the next message followed the question as a second user turn in a row."""
    engine = ScriptedEngine(["never seen", "second answer"], first_token_s=5.0)
    app = PagedChatApp(make_config(tmp_path), backend_factory=lambda progress: LocalBackend(engine))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        session = app.active_session
        prompt = app.chat_view(session).prompt
        prompt.focus()
        prompt.text = "first question"
        await pilot.press("enter")
        await wait_for(pilot, lambda: session.busy, "the reply to start")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not session.busy, "the stop")
        reply = session.record.messages[-1]
        assert reply.role == "assistant" and reply.content == "" and reply.stats.finish_reason == "cancelled"
        assert stats_line(reply.stats).endswith("stopped before the first token")
        await screen_is_disk(pilot)
        engine.first_token_s = 0.0
        await turn(pilot, "second question")
        roles = [m.role for m in session.record.messages]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert session.record.messages[-1].content == "second answer"
        await screen_is_disk(pilot)
