"""The app's side of the engine's refusals and failures: a stopped engine (the tab says why, the palette offers
a restart, and it works), sampling settings the engine would refuse, and finish reasons."""

from __future__ import annotations

import os
import signal

import pytest

from pagedchat.backends.local import LocalBackend
from pagedchat.engine.core import Phase
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.engine import Engine
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.commands import AppCommands
from pagedchat.engine.records import Outcome
from pagedchat.tui.conversation import ChatSettings, stats_line
from pagedchat.tui.screens.modals import ChatSettingsScreen
from tui_support import make_config, static_text, wait_for

SIZE = (100, 32)


class Broken(BaseException):
    """Escapes every step's recovery, as a loop that itself breaks."""


async def ask(pilot, text: str, max_tokens: int):
    """Send text in the active chat, greedy, with this reply budget: (the chat, its input)."""
    app = pilot.app
    session = app.active_session
    session.record.settings = ChatSettings(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
    prompt = app.chat_view(session).prompt
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    return session, prompt


def test_chat_settings_follow_the_request_rule_and_old_saved_values_fall_back():
    from pagedchat.config import AppConfig, ConfigError

    with pytest.raises(ValueError, match="temperature must be 0 \\(greedy\\) or at least 0.01"):
        ChatSettings(temperature=1e-40)
    with pytest.raises(ConfigError, match="sampling: top_p must be in"):
        AppConfig().with_overrides(top_p=2.0)
    saved = ChatSettings.from_dict({"max_tokens": 64, "temperature": 0.001, "top_k": 3, "unknown": 1})
    assert saved == ChatSettings(max_tokens=64, top_k=3)  # the refused temperature takes its default
    assert ChatSettings(temperature=0.5, seed=3).params(max_tokens=9) == \
        SamplingParams(max_tokens=9, temperature=0.5, top_p=0.95, seed=3)


def test_a_reply_at_the_context_limit_says_context_full():
    stats = Outcome(prompt_tokens=2040, generated_tokens=8, finish_reason="context_full")
    assert stats_line(stats).endswith("· context full")
    assert stats_line(Outcome(finish_reason="length")).endswith("· hit max tokens")


async def test_a_stopped_engine_is_shown_in_the_tab_and_can_be_restarted(tmp_path, long_tiny_model):
    engines: list[Engine] = []

    def factory(progress):
        def break_first_engine(phase, request_id):
            if len(engines) == 1 and phase is Phase.SAMPLE and engines[0].steps >= 3:
                raise Broken("the GPU fell off")

        engines.append(Engine(str(long_tiny_model), kv_cache_memory="4MiB", fault_hook=break_first_engine))
        return LocalBackend(engines[-1])

    app = PagedChatApp(make_config(tmp_path, long_tiny_model), backend_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the model to load")
        session, prompt = await ask(pilot, "hello there", max_tokens=20)
        await wait_for(pilot, lambda: app.backend.failure is not None and not session.busy, "the engine to stop")
        reply = session.record.messages[-1]
        assert reply.stats.finish_reason == "error"
        assert "engine stopped: Broken: the GPU fell off" in stats_line(reply.stats)
        await wait_for(pilot, lambda: "engine stopped" in static_text(app, "#status"), "the status line")
        assert static_text(app, "#status") == "engine stopped: Broken: the GPU fell off"

        prompt.text = "are you there?"
        await pilot.press("enter")  # refused while stopped: the text stays in the input
        assert prompt.text == "are you there?" and len(session.record.messages) == 2

        [restart] = [c for c in AppCommands(app.screen).commands() if c.title == "Restart engine"]
        restart.run()
        await wait_for(pilot, lambda: app.backend is not None and len(engines) == 2, "the new engine")
        assert not [c for c in AppCommands(app.screen).commands() if c.title == "Restart engine"]
        await pilot.press("enter")
        await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == 4, "a new reply")
        assert session.record.messages[-1].stats.finish_reason == "length"
        assert "engine stopped" not in static_text(app, "#status")


@pytest.mark.slow  # test_process_backend kills the engine; the stopped-engine test here restarts it in the app
async def test_a_killed_engine_process_keeps_the_reply_so_far_and_restarts(tmp_path, long_tiny_model):
    """The app's engine runs in a process of its own. Killed mid-reply (as the out-of-memory killer would), the
    app stays up: the reply keeps what came, the status line says what happened, and a restart brings it back."""
    app = PagedChatApp(make_config(tmp_path, long_tiny_model))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, "the model to load")
        first = app.backend
        session, prompt = await ask(pilot, "hello there", max_tokens=3500)  # seconds, not a blink
        await wait_for(pilot, lambda: session.busy and session.reply.tokens >= 10, "some of the reply")
        os.kill(first.pid, signal.SIGKILL)
        await wait_for(pilot, lambda: not session.busy, "the reply to end")
        reply = session.record.messages[-1]
        assert reply.stats.finish_reason == "error" and reply.stats.generated_tokens >= 10
        assert "killed by SIGKILL" in stats_line(reply.stats)
        await wait_for(pilot, lambda: "engine stopped" in static_text(app, "#status"), "the status line")
        assert "the engine process was killed by SIGKILL" in static_text(app, "#status")

        [restart] = [c for c in AppCommands(app.screen).commands() if c.title == "Restart engine"]
        restart.run()
        await wait_for(pilot, lambda: app.backend is not None and app.backend is not first, "the new engine")
        session.record.settings = ChatSettings(max_tokens=8, temperature=0.0, top_p=1.0)
        prompt.text = "are you back?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == 4, "a new reply")
        assert session.record.messages[-1].stats.finish_reason == "length"


async def test_the_settings_dialog_refuses_what_a_request_would(tmp_path, long_tiny_model):
    """F3 checks with SamplingParams' own rule: a temperature too small to divide by is refused, with why."""
    app = PagedChatApp(make_config(tmp_path, long_tiny_model))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        before = app.active_session.record.settings
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatSettingsScreen), "the settings dialog")
        app.screen.query_one("#temperature").value = "1e-40"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatSettingsScreen)
        assert str(app.screen.query_one("#error").content) == \
            "temperature must be 0 (greedy) or at least 0.01 (got 1e-40)"
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen), "the dialog to close")
        assert app.active_session.record.settings == before
