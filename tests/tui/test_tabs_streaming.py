"""Several tabs streaming at once: their replies' snapshots go to disk together, and a tab not shown renders
nothing until it is shown (issue 36: a key typed while four tabs streamed waited on both)."""

from __future__ import annotations

import time

from pagedchat.backends.local import LocalBackend
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui import chat_widgets
from pagedchat.tui.chat_widgets import MessageView
from pagedchat.tui.store import DB_NAME, Store
from tui_support import ScriptedEngine, make_config, quick_pilot, scripted_app, wait_for  # noqa: F401 (autouse)

SIZE = (140, 45)
LONG = "a long answer " * 400   # with chunks=400, streams for eight seconds or so


async def start_reply(pilot, text: str):
    app = pilot.app
    session = app.active_session
    prompt = app.active_chat.prompt
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: session.reply.tokens > 0, "the reply to stream")
    return session


def saved_lengths(app) -> dict[str, int]:
    """Each chat's last message as saved: its length, by chat id."""
    store = Store.read_only(app.config.data_dir / DB_NAME)
    try:
        return {c.id: len(c.messages[-1].content) for c in store.load_chats() if c.messages}
    finally:
        store.close()


async def first_reply_then_new_tab(app, pilot):
    """The first tab's reply streaming, and a second tab open and shown."""
    await wait_for(pilot, lambda: app.backend is not None, "the engine")
    first = await start_reply(pilot, "one")
    await pilot.press("ctrl+n")
    await wait_for(pilot, lambda: app.active_session is not first, "a new tab")
    return first


async def two_replies(app, pilot):
    first = await first_reply_then_new_tab(app, pilot)
    return first, await start_reply(pilot, "two")


async def test_two_streaming_tabs_are_saved_in_the_same_writes(tmp_path):
    app = scripted_app(tmp_path, [LONG, LONG], chunks=400)
    async with app.run_test(size=SIZE) as pilot:
        first, second = await two_replies(app, pilot)
        seen = []
        while first.busy and second.busy:
            lengths = saved_lengths(app)
            pair = (lengths.get(first.id, 0), lengths.get(second.id, 0))
            if not seen or pair != seen[-1]:
                seen.append(pair)
            await pilot.pause(0.02)
        changes = [(a != c, b != d) for (a, b), (c, d) in zip(seen, seen[1:])]
        together = changes.count((True, True))
        alone = len(changes) - together
        assert together >= 3, seen
        assert alone <= 1, seen   # the second reply's own first save, at its start, may fall alone


async def test_a_tab_not_shown_catches_up_when_shown(tmp_path, monkeypatch):
    # Flushes far apart, as on a loaded machine after slow screen updates: the reply's first falls due after its
    # tab is hidden.
    monkeypatch.setattr(chat_widgets, "FLUSH_S", 2.0)
    app = scripted_app(tmp_path, [LONG, LONG], chunks=400)
    async with app.run_test(size=SIZE) as pilot:
        first = await first_reply_then_new_tab(app, pilot)
        view = app.chat_view(first).view_at(first.reply.index)
        await pilot.pause(0.2)
        hidden = view.shown_source
        await pilot.pause(2.0)
        assert view.shown_source == hidden and first.reply.tokens > 0   # streams on, renders nothing
        await pilot.press("ctrl+pageup")
        await wait_for(pilot, lambda: app.active_session is first, "the first tab again")
        await wait_for(pilot, lambda: len(view.shown_source) > len(hidden), "the shown tab to catch up")
        assert isinstance(view, MessageView) and view.streaming


class CountingEngine(ScriptedEngine):
    """Counts the memory pictures asked of it (each costs the real engine's process a few ms between steps)."""

    asked = 0

    def memory(self):
        self.asked += 1
        return super().memory()


async def test_the_engine_is_asked_for_its_memory_only_while_the_inspector_shows_it(tmp_path):
    engine = CountingEngine([LONG], chunks=400)
    app = PagedChatApp(make_config(tmp_path), backend_factory=lambda progress: LocalBackend(engine))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        session = await start_reply(pilot, "one")
        asked = engine.asked
        await pilot.pause(1.0)   # four polls
        assert engine.asked == asked and session.busy
        await pilot.press("f2")
        await wait_for(pilot, lambda: engine.asked > asked + 1, "the inspector's pictures")
        assert session.busy


async def test_the_context_figure_of_a_streaming_chat_moves_about_once_a_second(tmp_path):
    app = scripted_app(tmp_path, [LONG], chunks=400)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        session = await start_reply(pilot, "one")
        prompt = app.active_chat.prompt
        figures = [str(prompt.border_subtitle)]
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            if str(prompt.border_subtitle) != figures[-1]:
                figures.append(str(prompt.border_subtitle))
            await pilot.pause(0.02)
        assert session.busy
        assert 2 <= len(figures) <= 4, figures   # it moves, but not at every 0.25 s poll (each is a redraw)


async def test_a_reply_goes_on_while_its_chat_has_no_log(tmp_path):
    """Updates can reach a chat whose log is not there: a tab not yet composed, or the app taking its widgets down
    as it closes. The reply's text is kept and the app does not fail (CI saw NoMatches here)."""
    text = "a steady answer " * 60
    app = scripted_app(tmp_path, [text], chunks=60)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        session = await start_reply(pilot, "one")
        await app.chat_view(session).log_view.remove()
        await wait_for(pilot, lambda: not session.busy, "the reply to end")
        assert session.record.messages[-1].content == text
        assert app._exception is None
