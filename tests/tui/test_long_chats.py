"""A chat of many thousand messages opens at once and stays light: only the messages around what is on screen
are mounted, older ones load as the user scrolls up, a search hit and the message walk reach any message, and a
reply scrolled out of the list streams on when scrolled back (issue 44, item 3)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.chat_widgets import MessageView, PromptInput
from pagedchat.tui.chat_ops import save_imported
from pagedchat.tui.conversation import ChatMessage, ChatRecord
from pagedchat.tui.store import Store
from test_tui_chatux import open_entry
from tui_support import make_config, quick_pilot, scripted_app, screen_text, send, wait_for  # noqa: F401 (autouse)

SIZE = (140, 45)
# Every message takes at least a row on screen, so more views than the screen has rows are more than it shows:
# the list mounts about a screen and a half at a time, and a few pages at most.
MOST_VIEWS = SIZE[1]
READY_S = 20.0   # the input is ready well within this even on a loaded CI machine (a second of CPU here)
GROWTH_MB = 300  # what opening the long chat may add to this process's memory


def long_chat_app(tmp_path: Path, count: int, special: dict[int, str] | None = None, replies=(),
                  chunks: int = 3) -> PagedChatApp:
    """The app over a ScriptedEngine (scripted_app's) with a chat of `count` short messages ("message N", or
    `special`'s text at its indexes) saved before it starts, as `pagedchat import` saves one."""
    special = special or {}
    messages = [ChatMessage("user" if i % 2 == 0 else "assistant", special.get(i, f"message {i}"))
                for i in range(count)]
    store = Store.open(make_config(tmp_path).data_dir)
    try:
        save_imported(store, ChatRecord(title="long", messages=messages))
    finally:
        store.close()
    return scripted_app(tmp_path, replies, chunks)


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


async def input_ready(pilot):
    """The chat in view, once its input has the keyboard."""
    app = pilot.app
    await wait_for(pilot, lambda: app.active_chat is not None and isinstance(app.focused, PromptInput),
                   "the input", timeout=READY_S)
    return app.active_chat


def indexes(chat) -> list[int]:
    return [v.index for v in chat.views]


def contiguous(chat) -> bool:
    shown = indexes(chat)
    return shown == list(range(shown[0], shown[0] + len(shown)))


def visible(chat, view: MessageView) -> bool:
    """Its first row is inside the log's area on screen."""
    log = chat.log_view.region
    return log.y <= view.region.y < log.bottom


async def load_older(pilot, chat) -> None:
    """`home` in the log: up to its top, where the page before it loads."""
    top = indexes(chat)[0]
    await pilot.press("home")
    await wait_for(pilot, lambda: indexes(chat)[0] < top, f"messages before {top}")
    assert len(chat.views) <= MOST_VIEWS and contiguous(chat)


async def load_newer(pilot, chat) -> None:
    """`end` in the log: down to its bottom, where the page after it loads."""
    bottom = indexes(chat)[-1]
    await pilot.press("end")
    await wait_for(pilot, lambda: indexes(chat)[-1] > bottom, f"messages after {bottom}")
    assert len(chat.views) <= MOST_VIEWS and contiguous(chat)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads this process's memory from /proc")
async def test_a_chat_of_many_thousand_messages_opens_at_once_mounting_a_screenful(tmp_path):
    count = 10_000
    before = rss_mb()
    started = time.monotonic()
    app = long_chat_app(tmp_path, count)
    async with app.run_test(size=SIZE) as pilot:
        chat = await input_ready(pilot)
        assert time.monotonic() - started < READY_S
        await wait_for(pilot, lambda: f"message {count - 1}" in screen_text(app), "the newest message on screen")
        assert 0 < len(chat.views) <= MOST_VIEWS and contiguous(chat) and indexes(chat)[-1] == count - 1
        assert len(chat.session.record.messages) == count   # the record keeps them all (export, the context)
        assert rss_mb() - before < GROWTH_MB


@pytest.mark.slow  # every page of 200 messages up and down: the other tests here load a page each way
async def test_scrolling_to_the_top_loads_older_messages_in_place_and_back_down(tmp_path):
    count = 200
    app = long_chat_app(tmp_path, count)
    async with app.run_test(size=SIZE) as pilot:
        chat = await input_ready(pilot)
        log = chat.log_view
        log.focus()
        first = chat.views[0]
        assert first.index > 0
        await load_older(pilot, chat)
        # What was at the top when the user reached it stays where it was: the new page is above it.
        at_top = log.region.y + first.styles.margin.top   # the first view's row, scrolled to the top
        await wait_for(pilot, lambda: log.scroll_y > 0 and first.region.y == at_top, "the place kept")
        assert indexes(chat)[-1] == count - 1

        # On to the first message, never mounting more than a few pages.
        while indexes(chat)[0] > 0:
            await load_older(pilot, chat)
        await pilot.press("home")   # the last page loaded above what was in view: up to it
        await wait_for(pilot, lambda: "message 0" in screen_text(app), "the first message on screen")
        assert indexes(chat)[-1] < count - 1   # the newest went, as the window moved up

        # And back down to the newest: the pages below load again.
        while indexes(chat)[-1] < count - 1:
            await load_newer(pilot, chat)
        await pilot.press("end")
        await wait_for(pilot, lambda: f"message {count - 1}" in screen_text(app), "the newest message again")


async def test_a_search_hit_on_an_old_message_opens_there(tmp_path):
    hit = 8
    app = long_chat_app(tmp_path, 2_000, {hit: "a question about aardvarks"})
    async with app.run_test(size=SIZE) as pilot:
        chat = await input_ready(pilot)
        assert hit not in indexes(chat)
        await open_entry(pilot, "Search chats…")
        await wait_for(pilot, lambda: "Search all chats…" in screen_text(app), "the search palette")
        await pilot.press(*"aardv")
        await wait_for(pilot, lambda: "long · You: a question about aardvarks" in screen_text(app), "the hit")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.focused, MessageView) and app.focused.index == hit,
                       "the hit focused")
        await wait_for(pilot, lambda: visible(chat, app.focused), "the hit on screen")
        assert len(chat.views) <= MOST_VIEWS and contiguous(chat)
        assert "a question about aardvarks" in screen_text(app)


@pytest.mark.slow  # 180 key presses across page loads: test_focus and test_rewrites walk short chats
async def test_the_message_walk_reaches_every_message_of_a_long_chat(tmp_path):
    count = 90
    app = long_chat_app(tmp_path, count)
    async with app.run_test(size=SIZE) as pilot:
        chat = await input_ready(pilot)
        assert indexes(chat)[0] > 0   # the walk has older messages to load
        await pilot.press("alt+up")
        for step, index in enumerate([*range(count - 1, -1, -1), *range(1, count)]):
            if step:
                await pilot.press("up" if index < app.focused.index else "down")
            await wait_for(pilot, lambda: isinstance(app.focused, MessageView) and app.focused.index == index,
                           f"message {index} focused")
            await wait_for(pilot, lambda: visible(chat, app.focused), f"message {index} on screen")
            assert len(chat.views) <= MOST_VIEWS
        await pilot.press("down")   # past the newest: back to the input
        await wait_for(pilot, lambda: isinstance(app.focused, PromptInput), "the input")


@pytest.mark.slow  # a long chat streaming out of view: test_tui streams a reply in view
async def test_a_reply_scrolled_out_of_the_list_streams_on_when_scrolled_back(tmp_path):
    count = 60   # the stand-in engine's context holds them all, so the message is sent
    app = long_chat_app(tmp_path, count, replies=["word " * 2000], chunks=2000)   # the reply takes a while
    async with app.run_test(size=SIZE) as pilot:
        chat = await input_ready(pilot)
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        session = await send(pilot, "go on")
        reply = len(session.record.messages) - 1
        await wait_for(pilot, lambda: session.record.messages[reply].content, "the reply's first words")

        chat.log_view.focus()
        while chat.view_at(reply) is not None:   # up, until the reply's view has gone
            await load_older(pilot, chat)
        while chat.view_at(reply) is None:       # and back down to it
            await load_newer(pilot, chat)
        view = chat.view_at(reply)
        assert session.busy and view.streaming
        await wait_for(pilot, lambda: view.is_mounted, "the reply's new view mounted")
        shown = len(view.shown_source)
        await wait_for(pilot, lambda: len(view.shown_source) > shown, "the reply growing in its new view")
        # What it shows is the reply so far, with nothing missed or repeated while it was being mounted.
        assert session.record.messages[reply].content.startswith(view.shown_source)

        await pilot.press("escape")
        await wait_for(pilot, lambda: not session.busy, "the reply stopped")
        assert view.shown_source == session.record.messages[reply].content
        assert "stopped" in str(view.query_one(".stats").content)
