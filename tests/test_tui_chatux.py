"""The chat app's finding-and-keeping features, driven with Pilot on a tiny real model: the context figure and
the check before sending, prompt recall, search across chats, deleting, export/import and compare."""

from __future__ import annotations

import pytest
from textual.content import Content

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.context import ContextFill, carried_messages
from pagedchat.tui.records import ChatMessage, ChatRecord, ReplyStats
from test_tui import SIZE, _quick_pilot, notes, ready, replied, send  # noqa: F401  (_quick_pilot: autouse)
from tiny_models import make_tiny_model
from tui_support import make_config, wait_for

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
    assert ContextFill(0, 8192).style() == "$text-muted"
    assert ContextFill(5734, 8192).style() == "$text-muted"   # 69.99%
    assert ContextFill(5735, 8192).style() == "$warning"
    assert ContextFill(7373, 8192).style() == "$error"
    assert ContextFill(1234, 8192).content().plain.strip() == "1,234 / 8,192"


def test_reply_line_says_context_full_apart_from_max_tokens():
    assert ReplyStats(finish_reason="context_full").line().endswith("context full")
    assert ReplyStats(finish_reason="length").line().endswith("hit max tokens")


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
        await wait_for(pilot, lambda: any("over the model's context" in n for n in notes(app)), "the notice")
        assert prompt.text == text and not session.record.messages and not session.busy
        assert any("Continue in a new chat" in n for n in notes(app))


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
        new = await continue_in_new_chat(app)
        assert app.active_session is new and new.record.system_prompt == "Be brief."
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
