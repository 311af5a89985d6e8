"""The app's one backend: loading it off the UI thread, the status bar that shows how that goes, why there is
none, an engine that stopped and its restart, an engine that stopped answering, and the periodic memory poll.

The backend starts on a daemon thread (bridge.start_loading); its progress, its arrival and its failure come
back as messages the app hands to `BackendLink`.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Callable

from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Label, ProgressBar

from pagedchat.backends.base import Backend, Progress, request_pages
from pagedchat.text import visible_controls
from pagedchat.tui.bridge import start_loading
from pagedchat.tui.inspector import InspectorView

BackendFactory = Callable[[Progress], Backend]
FILL_EVERY_S = 1.0   # a streaming chat's context figure moves this often: each change is a screen update
# A flush waits this long at most for the engine's steps to leave it a core (a decode step or two; a long
# prompt's chunk is not waited for), looking this often.
BORROW_WAIT_S = 0.01
BORROW_LOOK_S = 0.001


class StatusBar(Horizontal):
    """The bottom line: what is loading and how far, then the model, where it runs and how many chats generate."""

    def __init__(self, waiting: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._waiting = waiting

    def compose(self) -> ComposeResult:
        yield Label(self._waiting, id="status")
        yield ProgressBar(total=None, show_eta=False, id="load-progress")

    @property
    def whole(self) -> bool:
        """Both of its widgets are there."""
        return bool(self.query("#status")) and bool(self.query("#load-progress"))

    @property
    def line(self) -> Label:
        return self.query_one("#status", Label)

    @property
    def bar(self) -> ProgressBar:
        return self.query_one("#load-progress", ProgressBar)

    def loading(self, stage: str, fraction: float | None) -> None:
        if fraction is None:
            self.bar.update(total=None)
        else:
            self.bar.update(total=100, progress=fraction * 100)
        # A stage that says what it does ("loading weights", "compiling …", "connecting to …") stands alone;
        # a bare one (a file's name) is what is being loaded.
        says_what = stage.split(" ", 1)[0].lower().endswith("ing")
        prefix = "" if says_what else "loading "
        self.line.update(Content.assemble((prefix, "$text-muted"), visible_controls(stage)))

    def loading_again(self) -> None:
        self.bar.display = True
        self.bar.update(total=None)

    def loaded(self) -> None:
        self.bar.display = False
        # Determinate, so that its animation's timer stops: hidden, it still woke the main thread many times a
        # second to draw nothing, beside the engine's threads.
        self.bar.update(total=1, progress=1)

    def error(self, text: str) -> None:
        self.line.update(Content.styled(visible_controls(text), "$error"))

    def running(self, model: str, where: str) -> None:
        self.line.update(Content.assemble((visible_controls(model), "bold"), (visible_controls(where), "$text-muted")))


class BackendLink:
    """The backend once it is there (`backend`), else why not (`error`); what the app and the chats ask of it."""

    def __init__(self, app: App, factory: BackendFactory, reconnect_s: float | None = None) -> None:
        self.app = app
        self.factory = factory
        self.reconnect_s = reconnect_s   # a server that could not be reached is tried again this often
        self.backend: Backend | None = None
        self.error: str | None = None
        self._stop_noted = False      # the backend's failure has been shown
        self._stall_noted = False     # an engine that stopped answering has been told of
        self.error_said: str | None = None   # the last failure told in a notice

    @property
    def failure(self) -> str | None:
        return self.backend.failure if self.backend is not None else None

    def _status(self) -> StatusBar | None:
        """None once the app is closing: a load that ends during shutdown finds no widgets left, or a bar whose
        own widgets are gone or going (shutdown removes them one by one, before the bar)."""
        bars = self.app.query(StatusBar)
        return bars.first() if bars and bars.first().whole else None

    def start(self) -> None:
        self.error = None
        if (status := self._status()) is not None:
            status.loading_again()
        start_loading(self.app, self.factory)

    def progress(self, stage: str, fraction: float | None) -> None:
        if (status := self._status()) is not None:
            status.loading(stage, fraction)

    def arrived(self, backend: Backend) -> bool:
        """The backend is ready; False (and it is shut down) if the app is closing."""
        if (status := self._status()) is None:
            backend.shutdown()
            return False
        if self.error_said is not None:
            self.app.notify("Connected again.", timeout=4)
            self.error_said = None
        self.backend = backend
        status.loaded()
        # What exists now (the app's widgets, its chats, the backend's client) lives about as long as the app. Out
        # of the collector's reach, a full collection while replies stream walks only what came since: each walk
        # of everything held the main thread for tens of ms, which the engine's threads waited on at a barrier.
        # Unfrozen first, so that a backend this one replaces can go; the app unfreezes as it ends.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        return True

    def failed(self, error: str) -> None:
        said, self.error = self.error_said, error.rstrip(".") + "."
        if (status := self._status()) is None:
            return
        status.loaded()
        status.error(self.error)
        self.app.query_one(InspectorView).show_message(self.error)
        if self.error != said:   # each retry that fails the same way stays quiet
            self.app.notify(self.error, severity="error", timeout=15)
        self.error_said = self.error
        if self.reconnect_s is not None:
            # In the background, so that a server that comes back is there for the next message: else the
            # first Enter after it returned only said the old "Cannot reach" and sent nothing.
            self.app.set_timer(self.reconnect_s, self._reconnect)

    def _reconnect(self) -> None:
        if self.backend is None and self.error is not None:
            self.start()

    def show_status(self, generating: int) -> None:
        if self.backend is None or (status := self._status()) is None:
            return
        if self.backend.failure is not None:
            status.error(f"engine stopped: {self.backend.failure}")
            return
        if self._stall_noted and (quiet := self.backend.stalled_for()) is not None:
            status.error(f"engine not answering for {quiet:.0f} s (Esc stops a reply, keeping its text)")
            return
        info = self.backend.info
        pages = f" · {info.num_pages} pages" if info.num_pages else ""
        activity = f" · {generating} generating" if generating else ""
        status.running(info.model, f" {info.where}{pages}{activity}")

    def ready_or_say(self) -> Backend | None:
        """The backend, or a notice why there is none; one that failed to start is started again."""
        if self.failure is not None:
            self.app.notify(f"{self.stopped_text()} Your message is kept in the input.", severity="error", timeout=10)
            return None
        if self.backend is None and self.error:
            self.app.notify(f"Not connected yet (the last try: {self.error.rstrip('.')}). Trying again now; your "
                            "message is kept in the input.", severity="error", timeout=8)
            self.start()
        elif self.backend is None:
            self.app.notify("The model is still loading; your message is kept in the input.", severity="warning")
        return self.backend

    def stopped_text(self) -> str:
        return f"engine stopped: {self.failure}. Restart it from the command palette (Restart engine)."

    def note_stopped(self, generating: int) -> bool:
        """Once per failure: say in the status bar and a notice that the engine stopped, and how to restart."""
        if self.failure is None:
            return False
        if not self._stop_noted:
            self._stop_noted = True
            self.show_status(generating)
            self.app.notify(self.stopped_text(), severity="error", timeout=15)
        return True

    def note_stall(self, busy: list) -> bool:
        """Say once, while a reply waits on it, that the engine stopped answering, and once that it answers
        again; the status bar counts the seconds meanwhile. True while that is noted."""
        answering = self.backend.stalled_for() is None
        if not answering and busy and not self._stall_noted:
            self._stall_noted = True
            self.app.notify("The engine is not answering: its process is stopped or starved of CPU. Replies go on "
                            "once it answers; Esc stops one and keeps its text.", severity="warning", timeout=10)
        elif answering and self._stall_noted:
            self._stall_noted = False
            self.app.notify("The engine is answering again.", timeout=4)
            self.show_status(len(busy))
        if self._stall_noted:
            self.show_status(len(busy))
        return self._stall_noted

    def restart(self) -> None:
        """Load a fresh engine in place of one that stopped; the chats stay as they are."""
        old, self.backend, self._stop_noted, self._stall_noted = self.backend, None, False, False
        if old is not None:
            old.shutdown()
        if (status := self._status()) is not None:
            status.line.update("loading the model…")
        self.start()

    @property
    def _loan(self):
        """The backend's CoreLoan, where it lends cores (engine/core_loan.py)."""
        return self.backend.core_loan if self.backend is not None else None

    async def borrow_core(self) -> None:
        """Ask the engine for a core for a screen update, and wait until its steps leave one (BORROW_WAIT_S at
        most); nothing where the backend lends none. Give it back with give_back_core."""
        if (loan := self._loan) is None:
            return
        loan.ask()
        give_up = time.monotonic() + BORROW_WAIT_S
        while not loan.lent and time.monotonic() < give_up:
            await asyncio.sleep(BORROW_LOOK_S)

    def give_back_core(self) -> None:
        if (loan := self._loan) is not None:
            loan.give_back()

    def poll(self, chats, inspector: InspectorView, force: bool = False) -> None:
        """While something runs: the chat in view's context figure and stalls; while the inspector is open, the
        engine's memory and which pages each chat holds."""
        busy = [s for s in chats.sessions.values() if s.busy]
        if self.backend is None or self.note_stopped(len(busy)):
            return
        stalled = self.note_stall(busy)
        active = chats.active
        for session in busy:
            if (chat := chats.view(session)) is not None:
                if session is active:   # another chat's figure is put when it is shown (tabs.activated)
                    chat.show_fill(every=FILL_EVERY_S)
                if (message := chat.view_at(session.reply.index)) is not None:
                    message.mark_stalled(stalled)
        if not inspector.display:
            # The pages each chat holds are the inspector's alone: while it is hidden the engine's process is
            # not asked for them (a picture costs its main thread a few milliseconds between steps).
            return
        view = self.backend.memory()
        for session in busy:
            held = request_pages(view, session.reply.request_id)
            if held is not None:
                session.pages, session.page_tokens = held
        pages = chats.chat_pages()
        focused = next((c for c in pages if active and c.chat_id == active.id), None)
        inspector.update_view(view, pages, focused, force=force)
