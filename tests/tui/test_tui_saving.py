"""What the app saves, when, and what it does when a save fails or a request is refused (Pilot)."""

from __future__ import annotations

import sqlite3
from functools import partial

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.screens.modals import EditMessageScreen, UnsavedQuitScreen
from pagedchat.tui.store import DB_NAME, Store
from test_tui import SIZE, ready, replied, send
from test_tui import config, tui_model  # noqa: F401  (the same fixtures as the other app tests)
from tui_support import notices, quick_pilot, scripted_app, wait_for  # noqa: F401  (quick_pilot: autouse)

TOO_LONG = "word " * 3000  # more tokens than the model's context: the engine refuses the request


def stored_texts(config) -> list[str]:
    conn = sqlite3.connect(f"{(config.data_dir / DB_NAME).resolve().as_uri()}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT content FROM messages ORDER BY chat_id, idx, rowid")]
    finally:
        conn.close()


async def test_a_lock_held_past_the_timeout_is_a_notice_and_a_retry(config):
    app = PagedChatApp(config, open_store=partial(Store.open, busy_timeout_s=0.1))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        holder = sqlite3.connect(config.data_dir / DB_NAME, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another program writing, and not letting go
        session = await send(pilot, "saved later", max_tokens=8)
        await replied(pilot, session)
        await wait_for(pilot, lambda: any("Could not save chats" in n and "locked" in n for n in notices(app)),
                       "the save-failed notice")
        assert app.is_running and "saved later" not in stored_texts(config)
        holder.execute("ROLLBACK")
        holder.close()
        await wait_for(pilot, lambda: "saved later" in stored_texts(config), "the retry to save it", timeout=10)
        await wait_for(pilot, lambda: any("saved again" in n for n in notices(app)), "the saved-again notice")
        assert stored_texts(config) == [m.content for m in session.record.messages]


async def test_quit_asks_while_a_chat_cannot_be_saved_and_not_once_it_is(config):
    """Esc ("keep trying") goes back to the chats, the retries go on, and ctrl+q then quits without asking."""
    app = PagedChatApp(config, open_store=partial(Store.open, busy_timeout_s=0.1))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        holder = sqlite3.connect(config.data_dir / DB_NAME, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        await replied(pilot, await send(pilot, "saved later", max_tokens=8))
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: isinstance(app.screen, UnsavedQuitScreen), "the question")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, UnsavedQuitScreen), "back to the chats")
        assert app.is_running
        holder.execute("ROLLBACK")
        holder.close()
        await wait_for(pilot, lambda: "saved later" in stored_texts(config), "the retry to save it", timeout=10)
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running, "the app to quit without asking")


async def answered(pilot):
    """The active chat once it holds one question and its reply; and their texts."""
    await ready(pilot)
    session = await send(pilot, "first question", max_tokens=8)
    await replied(pilot, session)
    return session, [m.content for m in session.record.messages]


async def test_a_refused_regenerate_keeps_the_old_reply(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        session, before = await answered(pilot)
        app.backend.shutdown()  # the engine refuses every request from now on
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: any("shut down" in n for n in notices(app)), "the refusal")
        assert [m.content for m in session.record.messages] == before
        assert len(app.chat_view(session).views) == 2 and stored_texts(config) == before


async def test_a_refused_edit_or_message_changes_nothing(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        session, before = await answered(pilot)
        app.active_chat.edit_message(0)
        await wait_for(pilot, lambda: isinstance(app.screen, EditMessageScreen) and app.screen.query("#text"),
                       "the edit dialog")
        app.screen.query_one("#text").text = TOO_LONG
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: any("model's context holds" in n for n in notices(app)), "the refusal")
        assert [m.content for m in session.record.messages] == before and stored_texts(config) == before
        prompt = app.chat_view(session).prompt
        await send(pilot, TOO_LONG)
        await wait_for(pilot, lambda: sum("model's context holds" in n for n in notices(app)) == 2, "the refusal")
        assert prompt.text == TOO_LONG  # kept in the input, to shorten and send again
        assert [m.content for m in session.record.messages] == before and stored_texts(config) == before


async def test_a_closed_chat_reopens_with_its_unsent_input(tmp_path):
    app = scripted_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.active_chat is not None, "the chat")
        first = app.active_session
        app.active_chat.prompt.text = "not sent yet"
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_session is not first, "a second chat")
        app.chats.show(first)
        # In view and activated, as a user sees it before the next key: the input back under the cursor.
        await wait_for(pilot, lambda: app.active_session is first and app.focused is app.active_chat.prompt,
                       "the first chat in view, its input focused")
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: first.id not in app.sessions, "the chat closed")
        await app.reopen_chat(first.id)
        await wait_for(pilot, lambda: first.id in app.sessions, "the chat reopened")
        assert app.chat_view(app.sessions[first.id]).prompt.text == "not sent yet"
