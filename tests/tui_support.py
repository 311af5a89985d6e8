"""Helpers for the app tests: configs on temporary dirs, a stand-in backend, waiting on conditions, reading
the screen."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from pagedchat.backends.base import BackendInfo, MemoryView
from pagedchat.config import AppConfig, load_config
from pagedchat.tui.records import ChatSettings
from pagedchat.errors import PagedChatError

WAIT_S = 30.0


def make_config(tmp: Path, model: Path | str | None = None, **overrides) -> AppConfig:
    """An AppConfig whose config and data dirs live under tmp; greedy sampling so runs repeat."""
    defaults = dict(config_dir=tmp / "config", data_dir=tmp / "data", model=str(model) if model else None,
                    kv_cache_memory="4MiB", temperature=0.0, top_p=1.0, max_tokens=48)
    defaults.update(overrides)
    (tmp / "config").mkdir(parents=True, exist_ok=True)
    return load_config(None, **defaults)


async def wait_for(pilot, condition, what: str = "condition", timeout: float = WAIT_S) -> None:
    """Let the app run until condition() holds; fail after timeout seconds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await pilot.pause(0.01)


async def send(pilot, text: str, max_tokens: int | None = None):
    """Type into the active chat's input and press Enter; returns the chat's session."""
    app = pilot.app
    session = app.active_session
    if max_tokens is not None:
        session.record.settings = ChatSettings(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
    prompt = app.chat_view(session).prompt
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    return session


def screen_text(app) -> str:
    """The screen as plain text, for asserting on what the user sees."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in strip) for strip in strips)


def static_text(app, selector: str) -> str:
    """The plain text a Static (or Label) shows."""
    content = app.query_one(selector).content
    return getattr(content, "plain", str(content))


class StandInBackend:
    """The backend face with no model behind it: a fixed picture of memory, and no replies (submit refuses).
    For screens that must not move, such as the snapshot tests."""

    failure = None

    def __init__(self, memory: Callable[[], MemoryView], info: BackendInfo) -> None:
        self._memory = memory
        self.info = info

    def submit(self, messages, params, *, previous=None, on_update=None):
        raise PagedChatError("the stand-in backend writes no replies")

    def fork(self, parent, params, *, on_update=None):
        raise PagedChatError("the stand-in backend writes no replies")

    def memory(self) -> MemoryView:
        return self._memory()

    def shutdown(self) -> None:
        pass

