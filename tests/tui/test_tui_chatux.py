"""The chat app's finding-and-keeping features, driven with Pilot on a tiny real model: the context figure and
the check before sending, prompt recall, search across chats, deleting, export/import and compare."""

from __future__ import annotations

import pytest
from textual.content import Content

from pagedchat.backends.base import BackendInfo, MemoryUnavailable
from pagedchat.backends.local import LocalBackend
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.context import CHARS_PER_TOKEN, ContextFill, carried_messages, conversation_tokens
from pagedchat.engine.records import Outcome
from pagedchat.tui.conversation import ChatMessage, ChatRecord, stats_line
from test_tui import SIZE, ready, replied, send
from tiny_models import make_tiny_model
from tui_support import (ScriptedEngine, StandInBackend, make_config, notices, quick_pilot, screen_text,  # noqa: F401
                         scripted_app, wait_for)

CONTEXT = 256   # the tiny model's context: small, so a chat can fill it


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("chatux-model"), seed=1, max_positions=CONTEXT)


@pytest.fixture
def config(tmp_path, small_model):
    return make_config(tmp_path, small_model)


def border_text(app, session) -> str:
    return Content.from_markup(app.chat_view(session).prompt.border_subtitle).plain.strip()


# ---- context fill -----------------------------------------------------------------------------------------
def test_fill_colours_at_70_and_90_percent():
    assert ContextFill(0, 8192).style() == ""
    assert ContextFill(5734, 8192).style() == ""   # 69.99%: still the border's own colour
    assert ContextFill(5735, 8192).style() == "$warning"
    assert ContextFill(7373, 8192).style() == "$error"
    assert ContextFill(1234, 8192).content().plain.strip() == "1,234 / 8,192"


def test_local_backend_counts_the_prompt_it_submits():
    engine = ScriptedEngine(["ok"])
    backend = LocalBackend(engine)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    count = backend.prompt_tokens(messages)
    backend.submit(messages, None).result(10)
    assert count == len(engine.prompts[-1]) > 0


def test_a_backend_that_cannot_count_gets_an_estimate_for_carrying():
    backend = StandInBackend(lambda: MemoryUnavailable("none"), BackendInfo(model="m", where="far away"))
    assert backend.prompt_tokens([{"role": "user", "content": "hi"}]) is None
    conversation = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 20}]
    assert conversation_tokens(backend, conversation) == 60 // CHARS_PER_TOKEN


def test_reply_line_says_context_full_apart_from_max_tokens():
    assert stats_line(Outcome(finish_reason="context_full")).endswith("context full")
    assert stats_line(Outcome(finish_reason="length")).endswith("hit max tokens")


async def test_reply_shows_the_chat_against_the_context(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = app.active_session
        assert border_text(app, session) == f"0 / {CONTEXT}"
        await send(pilot, "hello there", max_tokens=20)
        await replied(pilot, session)
        stats = session.record.messages[-1].stats
        used = stats.prompt_tokens + stats.generated_tokens
        assert used > 20 and border_text(app, session) == f"{used} / {CONTEXT}"


async def test_prompt_that_cannot_fit_is_refused_and_kept(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = app.active_session
        text = "word " * CONTEXT
        prompt = await send(pilot, text)
        prompt = app.chat_view(session).prompt
        await wait_for(pilot, lambda: any("but the model's context holds 256" in n for n in notices(app)), "the notice")
        assert prompt.text == text and not session.record.messages and not session.busy
        assert any("Continue in a new chat" in n for n in notices(app))


async def test_a_backend_that_cannot_count_is_left_to_refuse(tmp_path):
    info = BackendInfo(model="m", where="via http://127.0.0.1:9/v1", context_length=16)
    backend = StandInBackend(lambda: MemoryUnavailable("none"), info)
    app = PagedChatApp(make_config(tmp_path), backend_factory=lambda progress: backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = app.active_session
        text = "word " * 64   # far past the 16 tokens, but nothing here can count them
        await send(pilot, text)
        await wait_for(pilot, lambda: any("writes no replies" in n for n in notices(app)), "the backend's refusal")
        assert not any("context holds" in n for n in notices(app))
        assert app.chat_view(session).prompt.text == text and not session.record.messages


def test_carry_over_keeps_whole_last_turns_that_fit():
    record = ChatRecord(system_prompt="sys", messages=[
        ChatMessage("user", "a" * 50), ChatMessage("assistant", "b" * 50),
        ChatMessage("user", "c" * 10), ChatMessage("assistant", "d" * 10),
        ChatMessage("user", "e" * 5)])
    count = lambda conv: sum(len(m["content"]) for m in conv)  # noqa: E731  (one "token" per character)
    assert [m.content[0] for m in carried_messages(record, count, 40)] == ["c", "d", "e"]
    assert [m.content[0] for m in carried_messages(record, count, 8)] == ["e"]
    assert carried_messages(record, count, 4) == []   # not even the last question fits: start empty


async def test_continue_in_a_new_chat_carries_the_system_prompt_and_last_turns(config):
    from pagedchat.tui.context import continue_in_new_chat

    app = PagedChatApp(config.with_overrides(system_prompt="Be brief."))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = await send(pilot, "first question " * 6, max_tokens=40)
        await replied(pilot, session)
        session = await send(pilot, "second", max_tokens=8)
        await replied(pilot, session)
        counting = continue_in_new_chat(app)   # on a thread: counting asks the engine
        await wait_for(pilot, lambda: not counting.is_alive() and app.active_session is not session, "the new chat")
        new = app.active_session
        assert new.record.system_prompt == "Be brief."
        # Half the context (128 tokens) holds the last exchange but not both.
        assert [m.content for m in new.record.messages] == [m.content for m in session.record.messages[2:]]


async def press_for(pilot, key: str, condition) -> None:
    await pilot.press(key)
    await wait_for(pilot, condition, f"the effect of {key}", timeout=5)


# ---- prompt recall ----------------------------------------------------------------------------------------
async def test_up_recalls_earlier_prompts_across_chats_and_down_comes_back(config):
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = await send(pilot, "first prompt", max_tokens=4)
        await replied(pilot, session)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_session is not session, "a new tab")
        other = await send(pilot, "second prompt", max_tokens=4)
        await replied(pilot, other)
        prompt = app.chat_view(other).prompt
        prompt.focus()
        prompt.text = "draft"
        prompt.move_cursor((0, 0))
        await press_for(pilot, "up", lambda: prompt.text == "second prompt")
        await press_for(pilot, "up", lambda: prompt.text == "first prompt")    # from the other chat
        await press_for(pilot, "up", lambda: prompt.text == "first prompt")    # the oldest stays
        await press_for(pilot, "down", lambda: prompt.text == "second prompt")
        await press_for(pilot, "down", lambda: prompt.text == "draft")         # what was typed comes back
        prompt.text = "line one\nline two"
        prompt.move_cursor((1, 3))
        await pilot.press("up")
        await pilot.pause(0.2)
        assert prompt.text == "line one\nline two" and prompt.cursor_location[0] == 0  # plain cursor movement

    # After a restart the prompts come from the database.
    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.chat_view(app.active_session).prompt
        prompt.text = ""
        prompt.focus()
        await press_for(pilot, "up", lambda: prompt.text == "second prompt")


@pytest.mark.slow  # the history through the palette: up and down walk it in the quick run
async def test_prompt_history_palette_puts_a_fuzzy_match_in_the_input(config):

    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for text in ("explain paged attention", "write a haiku about caches"):
            session = await send(pilot, text, max_tokens=4)
            await replied(pilot, session)
        await open_entry(pilot, "Prompt history…")
        await wait_for(pilot, lambda: "Search earlier prompts…" in screen_text(app), "the history palette")
        await pilot.press(*"hku")  # fuzzy: h..k..u of "haiku"
        await wait_for(pilot, lambda: palette_lines(app) == ["write a haiku about caches"], "the fuzzy match")
        await pilot.press("enter")
        prompt = app.chat_view(app.active_session).prompt
        await wait_for(pilot, lambda: prompt.text == "write a haiku about caches", "the prompt in the input")


def palette_lines(app) -> list[str]:
    """The hits the open palette lists, as plain text."""
    from textual.command import CommandList

    commands = app.screen.query_one(CommandList)
    return [commands.get_option_at_index(i).hit.text for i in range(commands.option_count)]


async def open_entry(pilot, title: str) -> None:
    """ctrl+p, type the entry's title, Enter: as a user reaches any palette entry."""
    from textual.command import CommandPalette

    app = pilot.app
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), "the palette")
    app.screen.query_one("CommandInput").value = title
    await wait_for(pilot, lambda: title in screen_text(app), f"{title!r} listed")
    await pilot.press("enter")


# ---- search across chats ----------------------------------------------------------------------------------
async def test_search_finds_a_closed_chat_and_opens_it_at_the_message(config):
    from pagedchat.tui.chat_widgets import MessageView

    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = await send(pilot, "tell me about aardvarks", max_tokens=4)
        await replied(pilot, first)
        first.record.title = "Animals"
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_session is not first, "a second tab")
        await pilot.press("ctrl+pageup")
        await wait_for(pilot, lambda: app.active_session is first, "the first tab")
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: first.id not in app.sessions, "the close")

        await open_entry(pilot, "Search chats…")
        await wait_for(pilot, lambda: "Search all chats…" in screen_text(app), "the search palette")
        await pilot.press(*"aardv")
        await wait_for(pilot, lambda: "Animals · You: tell me about aardvarks" in screen_text(app), "the hit")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.active_session is not None and app.active_session.id == first.id,
                       "the chat reopened")
        await wait_for(pilot, lambda: isinstance(app.focused, MessageView) and app.focused.index == 0,
                       "the message focused")


def long_chat(title: str, words: dict[int, str]) -> ChatRecord:
    """A chat many screens tall: every reply has a list and a code block. words: message index -> a word."""
    messages = []
    for i in range(24):
        text = f"{words.get(i, 'filler')} " + "\n\n".join(f"message {i} paragraph {p}" for p in range(4))
        if i % 2:
            text += "\n\n" + "\n".join(f"- item {k} with `code`" for k in range(15))
            text += "\n\n```python\n" + "\n".join(f"x{k} = {k}" for k in range(15)) + "\n```\n"
        messages.append(ChatMessage("assistant" if i % 2 else "user", text))
    return ChatRecord(title=title, messages=messages)


def at_top(view, message) -> bool:
    """The message is laid out and its top row is the first (after its margin) that the chat's log shows."""
    region = message.virtual_region
    return bool(region) and 0 <= region.y - view.log_view.scroll_y <= message.styles.margin.top


@pytest.mark.slow  # many jumps: test_search_finds_a_closed_chat_and_opens_it_at_the_message searches
async def test_search_jumps_in_a_row_land_on_each_hit(tmp_path):
    """Jumps between two long chats: the third goes back to a chat already shown, now in a hidden tab."""
    from pagedchat.tui.chat_widgets import MessageView
    from pagedchat.tui.store import Store

    app = scripted_app(tmp_path)
    store = Store.open(app.config.data_dir)
    for position, chat in enumerate((long_chat("Alpha", {4: "aardvark", 18: "anteater"}),
                                     long_chat("Bravo", {10: "bison", 20: "badger"}))):
        chat.position = position
        store.save_chat(chat)
    store.close()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: len(app.sessions) == 2, "the two chats")
        for title, word, index in (("Alpha", "aardvark", 4), ("Bravo", "bison", 10), ("Alpha", "anteater", 18),
                                   ("Bravo", "badger", 20)):
            await open_entry(pilot, "Search chats…")
            await wait_for(pilot, lambda: "Search all chats…" in screen_text(app), "the search palette")
            await pilot.press(*word)
            await wait_for(pilot, lambda: f"{title} · You: {word}" in screen_text(app)
                           or f"{title} · Assistant: {word}" in screen_text(app), f"the hit for {word}")
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.active_session.record.title == title
                           and isinstance(app.focused, MessageView) and app.focused.index == index
                           and at_top(app.active_chat, app.focused), f"message {index} of {title} at the top")
            await pilot.pause(0.2)   # and it stays there
            assert app.focused.index == index and at_top(app.active_chat, app.focused)
            assert f"{word} message {index} paragraph 0" in screen_text(app)


# ---- delete -----------------------------------------------------------------------------------------------
async def test_f8_deletes_a_chat_for_good_after_asking(config):
    from pagedchat.tui.screens.ask import ConfirmScreen
    from pagedchat.tui.store import Store

    app = PagedChatApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        doomed = await send(pilot, "secret zebra plans", max_tokens=4)
        await replied(pilot, doomed)
        await pilot.press("f8")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmScreen), "no")
        assert doomed.id in app.sessions
        await pilot.press("f8")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question again")
        await pilot.press("y")
        await wait_for(pilot, lambda: any(n.startswith("Deleted") for n in notices(app)), "the delete")
        assert doomed.id not in app.sessions
        assert len(app.sessions) == 1 and app.active_session.record.messages == []   # a fresh chat in its place
        assert "secret zebra plans" not in app.prompt_history.prompts
    store = Store.open(config.data_dir)
    assert doomed.id not in {r.id for r in store.load_chats()}
    assert store.search("zebra") == []
    store.close()
    app = PagedChatApp(config)   # and after a restart
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "the chats")
        assert doomed.id not in app.sessions
        assert all(r.id != doomed.id for r in app.store.load_chats())


# ---- export and import ------------------------------------------------------------------------------------
@pytest.mark.slow  # test_tui exports a chat, test_cli imports JSON exports back
async def test_ctrl_o_json_export_imports_back(config):
    from textual.widgets import OptionList

    from pagedchat.tui.chat_ops import import_chat
    from pagedchat.tui.screens.modals import PickScreen

    app = PagedChatApp(config.with_overrides(system_prompt="Be kind."))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session = await send(pilot, "export me", max_tokens=6)
        await replied(pilot, session)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, PickScreen), "the format question")
        options = app.screen.query_one(OptionList)
        # The dialog opens on the first option, Markdown (what Enter has always written).
        assert str(options.highlighted_option.prompt).startswith("Markdown") and options.highlighted == 0
        await pilot.press("down", "enter")   # from Markdown down to JSON
        folder = config.data_dir / "exports"
        await wait_for(pilot, lambda: folder.exists() and list(folder.glob("*.json")), "the JSON file")
        [path] = folder.glob("*.json")
        imported = await import_chat(app, path)
        assert app.active_session is imported and imported.id != session.id
        # The same title would make the two chats (and their delete prompts) look alike.
        assert imported.record.system_prompt == "Be kind."
        assert imported.record.title == f"{session.record.title} (imported)"
        assert [(m.role, m.content) for m in imported.record.messages] == \
               [(m.role, m.content) for m in session.record.messages]
        assert imported.record.settings == session.record.settings
        again = await import_chat(app, path)
        assert again.record.title == f"{session.record.title} (imported 2)"
        await wait_for(pilot, lambda: any(n.startswith(f"Imported “{again.record.title}”") for n in notices(app)),
                       "the notice with the new title")
        bad = folder / "bad.json"
        bad.write_text('{"messages": [{"role": "tool", "content": "x"}]}')
        assert await import_chat(app, bad) is None
        await wait_for(pilot, lambda: any("bad.json: message 1 has role 'tool'" in n for n in notices(app)),
                       "the one-line refusal")


# ---- compare ----------------------------------------------------------------------------------------------
async def test_compare_writes_two_answers_at_once_and_keeps_one(config):
    from pagedchat.tui.screens.compare import CompareScreen, CompareSetupScreen

    app = PagedChatApp(config)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        session = await send(pilot, "compare this", max_tokens=8)
        await replied(pilot, session)
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareSetupScreen), "the form")
        app.screen.query_one("#max_tokens-A").value = "150"
        app.screen.query_one("#max_tokens-B").value = "150"
        app.screen.query_one("#temperature-B").value = "1.5"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareScreen), "the split view")
        screen = app.screen
        a, b = screen.sides
        # The tiny model writes both answers in a fraction of a second, often before the screen's first
        # frame, so what is checked is what their outcomes say: both started on the chat's cached prompt
        # pages, and their block tables share those physical pages.
        await wait_for(pilot, lambda: not a.running and not b.running, "both done", timeout=60)
        assert a.outcome.cached_tokens > 0 and b.outcome.cached_tokens > 0
        shared = set(a.outcome.pages) & set(b.outcome.pages)
        assert shared, "both answers map the chat's prompt pages"
        await pilot.press("f2")
        # Its own inspector lists both sides with what each request held (prompt plus reply tokens).
        await wait_for(pilot, lambda: screen.inspector.display and all(
            f"{side.name} · comp" in screen_text(app) and f"{side.outcome.total_tokens} tok" in screen_text(app)
            for side in (a, b)), "both sides in the compare screen's inspector")
        assert a.outcome.text != b.outcome.text and b.variant.settings.temperature == 1.5
        await pilot.press("2")
        await wait_for(pilot, lambda: len(app.sessions) == 2, "the kept answer as a chat")
        kept = app.active_session
        assert kept is not session and kept.record.settings.temperature == 1.5
        assert kept.record.messages[-1].content == b.outcome.text
        assert [m.content for m in kept.record.messages[:-1]] == [session.record.messages[0].content]
