"""Between the engine's threads and Textual's event loop.

The engine calls on_update on its own thread once per step per request. UpdateInbox collects those updates
under a lock and posts at most one UpdatesReady message at a time: however fast the engine steps, the UI
queue holds one wake-up, and the UI takes everything that arrived since in one go. Loading the model runs on
a daemon thread (not a Textual thread worker) so that quitting during a long first-run download is immediate.
"""

from __future__ import annotations

import threading
from typing import Callable

from textual.app import App
from textual.message import Message

from pagedchat.engine.records import Update


class UpdatesReady(Message):
    """Updates are waiting in the inbox."""


class LoadProgress(Message):
    def __init__(self, stage: str, fraction: float | None) -> None:
        super().__init__()
        self.stage = stage
        self.fraction = fraction


class EngineReady(Message):
    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine


class EngineFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


def _post(app: App, message: Message) -> bool:
    """post_message from another thread; False once the app's loop is gone (quitting)."""
    try:
        return app.post_message(message)
    except RuntimeError:  # the event loop closed under us
        return False


class UpdateInbox:
    """Thread-safe hand-off of (chat id, Update) pairs from the backend's thread to the UI thread."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._items: list[tuple[str, Update]] = []
        self._posted = False

    def put(self, chat_id: str, update: Update) -> None:
        """The backend's thread. Never touches widgets."""
        with self._lock:
            self._items.append((chat_id, update))
            if self._posted:
                return
            self._posted = True
        _post(self._app, UpdatesReady())

    def take(self) -> list[tuple[str, Update]]:
        """UI thread: everything queued so far."""
        with self._lock:
            items, self._items = self._items, []
            self._posted = False
        return items

    def callback(self, chat_id: str) -> Callable:
        return lambda update: self.put(chat_id, update)


def start_loading(app: App, factory: Callable) -> threading.Thread:
    """Run factory(progress) on a daemon thread; the result arrives as EngineReady or EngineFailed."""

    def progress(stage: str, fraction: float | None) -> None:
        _post(app, LoadProgress(stage, fraction))

    def run() -> None:
        try:
            engine = factory(progress)
        except Exception as exc:  # every failure becomes one line in the app, never a traceback on screen
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _post(app, EngineFailed(text))
            return
        if not _post(app, EngineReady(engine)):
            engine.shutdown()  # the app closed while we were loading

    thread = threading.Thread(target=run, name="pagedchat-load", daemon=True)
    thread.start()
    return thread
