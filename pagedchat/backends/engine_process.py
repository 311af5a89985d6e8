"""The engine process's side of `process.ProcessBackend`: a LocalBackend driven over a socket pair.

The first message in is the Engine's keyword arguments; then tuples.
- In: ("call", key, method, args), ("cancel", reply key), ("forget", reply key) once the app has had its last
  update, ("memory",) and ("stop",).
- Out while loading: ("progress", stage, fraction), then ("ready", info, memory) or ("failed", text).
- Out after: ("updates", [(reply key, Update, the reply's figures so far), ...]), ("result", key, value,
  error), ("memory", MemorySnapshot) when asked and just before each reply's last update, ("failure", text), and
  ("alive",) every HEARTBEAT_S in which nothing else went out.
Calls are answered on this process's main thread; updates are sent from the engine's thread as it steps. The
heartbeat has a thread of its own, so that neither a long step nor a slow call reads as an engine that stopped.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from pagedchat.engine.core_loan import CoreLoan
from pagedchat.errors import PagedChatError, first_line

POLL_S = 0.25   # how often, when no call comes, the engine's loop is checked for a failure to report
# Updates go to the app at most this often, batched (a reply's first after a pause and its last at once): each
# send wakes two of the app's threads, and each wake-up on a busy core stalls the step's parallel ops.
BATCH_S = 0.05
# A sign of life when nothing else is sent for this long: the app tells an engine that stopped answering (a
# stopped or swamped process) from one busy with a long prefill by it (process.STALL_S).
HEARTBEAT_S = 0.5


class EngineServer:
    def __init__(self, conn, backend) -> None:
        self.conn = conn
        self.backend = backend
        self.replies: dict[int, Any] = {}  # until the app has had the last update and says forget
        self._send_lock = threading.Lock()
        self._outbox: list[tuple] = []    # (reply key, Update, figures) not yet sent
        self._sent_at = 0.0               # updates last went out
        self._said_at = 0.0               # anything last went out
        self._failure_sent = False

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self._send(message)

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
            self._said_at = time.monotonic()
        except (OSError, ValueError):  # the app is gone; the main loop sees it and stops
            pass

    def beat(self) -> None:
        """The heartbeat thread's loop, until the process ends (a daemon: it beats through the shutdown too)."""
        while True:
            time.sleep(HEARTBEAT_S / 2)
            with self._send_lock:
                if time.monotonic() - self._said_at >= HEARTBEAT_S:
                    self._send(("alive",))

    def send_memory(self) -> None:
        """The memory picture, taken and sent under the send lock, so that pictures arrive in the order taken
        and the app's latest is the newest."""
        with self._send_lock:
            self._send(("memory", self.backend.memory()))

    def flush_updates(self) -> None:
        with self._send_lock:
            if time.monotonic() - self._sent_at >= BATCH_S:
                self._send_updates()

    def _send_updates(self) -> None:
        if self._outbox:
            self._send(("updates", self._outbox))
            self._outbox, self._sent_at = [], time.monotonic()

    def updates_for(self, key: int):
        def on_update(update) -> None:
            reply = self.replies.get(key)  # None for an update that comes before submit has returned
            figures = reply.so_far() if reply is not None and update.outcome is None else None
            with self._send_lock:
                self._outbox.append((key, update, figures))
                if update.outcome is not None:
                    # The pages as the reply leaves them, ahead of its end: the app shows it idle at once.
                    self._send(("memory", self.backend.memory()))
                    self._send_updates()
                elif time.monotonic() - self._sent_at >= BATCH_S:
                    self._send_updates()
        return on_update

    def _keep(self, key: int, reply):
        """(request id, figures so far): the app keeps them, so it never has to ask for them."""
        self.replies[key] = reply
        return reply.request_id, reply.so_far()

    # What a call may run: the face's methods, with replies named by key.
    def submit(self, key: int, messages, params, previous):
        return self._keep(key, self.backend.submit(messages, params, previous=previous,
                                                   on_update=self.updates_for(key)))

    def fork(self, key: int, parent_key: int, params):
        return self._keep(key, self.backend.fork(self._reply(parent_key), params, on_update=self.updates_for(key)))

    def _reply(self, key: int):
        if key not in self.replies:
            raise PagedChatError("That reply has finished.")
        return self.replies[key]

    def prompt_tokens(self, messages, previous):
        return self.backend.prompt_tokens(messages, previous)

    CALLS = ("submit", "fork", "prompt_tokens")

    def answer(self, key: int, name: str, args: tuple) -> None:
        try:
            if name not in self.CALLS:
                raise PagedChatError(f"the engine process has no call {name!r}")
            self.send("result", key, getattr(self, name)(*args), None)
        except Exception as exc:  # handed to the caller, who raises it; PagedChatError's kinds pickle as they are
            error = exc if isinstance(exc, PagedChatError) else PagedChatError(first_line(exc))
            self.send("result", key, None, error)

    def run(self) -> None:
        """Until the app says stop or goes away."""
        threading.Thread(target=self.beat, name="pagedchat-heartbeat", daemon=True).start()
        while True:
            try:
                ready = self.conn.poll(BATCH_S if self._outbox else POLL_S)
                message = self.conn.recv() if ready else None
            except (EOFError, OSError):
                return
            self.flush_updates()
            self.report_failure()
            if message is None:
                continue
            kind, *rest = message
            if kind == "stop":
                return
            if kind == "cancel":
                reply = self.replies.get(rest[0])
                if reply is not None:
                    reply.cancel()
            elif kind == "forget":
                self.replies.pop(rest[0], None)
            elif kind == "memory":
                self.send_memory()
            elif kind == "call":
                self.answer(*rest)

    def report_failure(self) -> None:
        if self.backend.failure is not None and not self._failure_sent:
            self._failure_sent = True
            self.send("failure", self.backend.failure)


def serve(conn, loan: CoreLoan | None = None) -> None:
    """Load the engine the app's first message asks for, say so, then answer the app until it stops or goes.
    loan: the page through which the app's UI borrows a core from the engine's steps."""
    options = conn.recv()
    progress = lambda stage, fraction: conn.send(("progress", stage, fraction))  # noqa: E731
    try:
        from pagedchat.backends.local import LocalBackend
        from pagedchat.engine.engine import Engine

        backend = LocalBackend(Engine(**options, progress=progress, core_loan=loan))
    except Exception as exc:
        conn.send(("failed", f"The model could not be loaded: {first_line(exc)}"))
        return
    try:
        conn.send(("ready", backend.info, backend.memory()))
        EngineServer(conn, backend).run()
    finally:
        backend.shutdown()


def main(fd: str, page_fd: str) -> None:
    """The process's start (process.start_process): fd is this end of the app's socket pair, page_fd the file of
    the CoreLoan page. Its stdout and stderr are the engine log, so a native crash's trace lands there too."""
    faulthandler.enable()
    loan = CoreLoan(int(page_fd))
    os.close(int(page_fd))
    try:
        serve(Connection(int(fd)), loan)
    except (EOFError, OSError):  # the app went away while we loaded or answered
        pass
