"""The engine in a process of its own, behind the same backend face: what the app runs.

Why a process: in one process the UI thread and the engine's thread share one GIL. Every torch op lets go of it, and
while the UI draws, the engine then waits a switch interval to take it back after each of a step's many small ops,
so a reply slows by far more than the UI's own share of the CPU (docs/bench.md#the-engine-in-a-process-of-its-own).
vLLM's V1 engine moved its core out of the API server's process for the same reason. A separate process also keeps
the app alive when the engine dies (out of memory, a crash in native code): its replies end with an error, the chats
stay, and the app offers a restart.

This side imports no torch: the app's process never loads it. The other side is `engine_process.serve`.
"""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import threading
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagedchat import interpreter
from pagedchat.backends.base import BackendInfo, OnUpdate, Progress
from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.errors import PagedChatError

CALL_TIMEOUT_S = 30.0     # a call the engine process does not answer in this long is given up on
STOP_TIMEOUT_S = 10.0     # then it is killed


class ProcessHandle:
    """One reply in the engine process, followed here from the updates it sends."""

    def __init__(self, backend: "ProcessBackend", key: int, on_update: OnUpdate | None) -> None:
        self._backend = backend
        self.key = key
        self.request_id = ""
        self._on_update = on_update
        self._text: list[str] = []
        self._tokens = 0
        self._final: Outcome | None = None
        self._figures: Outcome | None = None   # so far, as the engine process last sent them
        self._done = threading.Event()

    def started(self, request_id: str, figures: Outcome) -> None:
        """The call's answer; its updates may have come first, with newer figures."""
        self.request_id, self._figures = request_id, self._figures or figures

    def deliver(self, update: Update, figures: Outcome | None = None) -> None:
        """The reader thread: pass it on, and keep what an ending without the engine needs."""
        self.request_id = update.request_id
        self._figures = figures or self._figures
        self._text.append(update.text)
        self._tokens += update.tokens
        if update.outcome is not None:
            self._final = update.outcome
            self._done.set()
        if self._on_update is not None:
            self._on_update(update)

    def end(self, error: str) -> None:
        """The engine process is gone: the last update, with the text and the figures so far."""
        outcome = replace(self._figures or Outcome(self.request_id), text="".join(self._text),
                          finish_reason=FinishReason.ERROR, generated_tokens=self._tokens, error=error)
        self.deliver(Update(self.request_id, "", outcome=outcome))

    def cancel(self) -> None:
        self._backend.send("cancel", self.key)

    def so_far(self) -> Outcome:
        """Never a round trip: the UI thread asks on every poll."""
        return self._final or self._figures or Outcome(self.request_id)

    def result(self, timeout: float | None = None) -> Outcome:
        if not self._done.wait(timeout):
            raise TimeoutError(f"no outcome for {self.request_id or 'the reply'} within {timeout} s")
        return self._final


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"the engine process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the engine process was killed by signal {-code}"
    return f"the engine process exited (code {code})"


def start_process(log_path: Path | None) -> tuple[subprocess.Popen, Connection]:
    """A fresh interpreter running engine_process.main, and our end of the socket pair to it. Not a fork (the app's
    threads would be copied mid-flight) nor multiprocessing's spawn (which runs the caller's main script again).
    Its own session: the terminal's signals are the app's, and the process ends when its socket closes."""
    ours, theirs = socket.socketpair()
    log = open_log(log_path)
    try:
        process = subprocess.Popen(interpreter.command("pagedchat.backends.engine_process", "main",
                                                       str(theirs.fileno())),
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        theirs.close()
        if log is not subprocess.DEVNULL:
            log.close()
    return process, Connection(ours.detach())


def open_log(path: Path | None):
    """The engine log, emptied at each start; nowhere if it cannot be written (the engine still runs)."""
    if path is None:
        return subprocess.DEVNULL
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")
    except OSError:
        return subprocess.DEVNULL


class ProcessBackend:
    """The app's Backend: pagedchat's Engine, built from `options` (Engine keyword arguments) in a child process.
    Slow to construct (the child loads the model; `progress` hears how it goes); raises PagedChatError when the
    model cannot be loaded or the process dies first."""

    def __init__(self, options: dict[str, Any], progress: Progress,
                 log_path: Path | None = None) -> None:
        self._log_path = log_path
        self._process, self._conn = start_process(log_path)
        self._conn.send(options)
        self._send_lock = threading.Lock()
        self._keys = itertools.count(1)
        self._calls: dict[int, Future] = {}
        self._replies: dict[int, ProcessHandle] = {}
        self._memory_asked = False
        self._closing = False
        self.failure: str | None = None
        self.info, self._memory = self._await_ready(progress)
        self._reader = threading.Thread(target=self._read, name="pagedchat-engine-reader", daemon=True)
        self._reader.start()

    def _await_ready(self, progress) -> tuple[BackendInfo, Any]:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                raise PagedChatError(f"The model could not be loaded: {exit_text(self._wait())}") from None
            kind, *rest = message
            if kind == "progress":
                progress(*rest)
            elif kind == "ready":
                return rest[0], rest[1]
            else:  # "failed"
                self._wait()
                self._conn.close()
                raise PagedChatError(rest[0])

    @property
    def pid(self) -> int:
        return self._process.pid

    def _wait(self) -> int | None:
        """The process's exit code once it ends; killed if it takes longer than STOP_TIMEOUT_S."""
        try:
            return self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait()

    # -- talking to the engine process

    def send(self, *message: Any) -> bool:
        """Send without waiting; False once the process is gone."""
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):  # the pipe is closed (ValueError: we closed it ourselves)
                return False

    def call(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run a LocalBackend method in the engine process and wait for its result (its error is raised here)."""
        if self._closing:
            raise PagedChatError("The engine has been shut down.")
        if self.failure is not None:
            raise PagedChatError(f"The engine stopped: {self.failure}")
        key, future = next(self._keys), Future()
        self._calls[key] = future
        if not self.send("call", key, name, args):
            self._calls.pop(key, None)
            raise PagedChatError(f"The engine stopped: {self.failure or 'its process is gone'}")
        try:
            return future.result(timeout)
        except TimeoutError:
            self._calls.pop(key, None)
            raise PagedChatError(f"The engine process did not answer {name} within {timeout:.0f} s") from None

    def _read(self) -> None:
        while True:
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError):
                break
            if kind == "updates":
                for key, update, figures in rest[0]:
                    self._deliver(key, update, figures)
            elif kind == "result":
                key, value, error = rest
                future = self._calls.pop(key, None)
                if future is not None:
                    future.set_exception(error) if error is not None else future.set_result(value)
            elif kind == "memory":
                self._memory, self._memory_asked = rest[0], False
            elif kind == "failure":  # the engine's loop broke; the process is still there to say so
                self.failure = rest[0]
        self._gone()

    def _deliver(self, key: int, update: Update, figures: Outcome | None) -> None:
        reply = self._replies.get(key)
        if reply is not None:
            reply.deliver(update, figures)
            if update.outcome is not None:
                self._replies.pop(key, None)
                self.send("forget", key)

    def _gone(self) -> None:
        """The process has ended: end every live reply and waiting call with the reason."""
        code = self._wait()
        if not self._closing and self.failure is None:
            self.failure = exit_text(code) + self._log_note()
        reason = self.failure or "the engine was shut down"
        for key in list(self._calls):
            future = self._calls.pop(key, None)
            if future is not None:
                future.set_exception(PagedChatError(f"The engine stopped: {reason}"))
        for key in list(self._replies):
            reply = self._replies.pop(key, None)
            if reply is not None:
                reply.end(reason)

    def _log_note(self) -> str:
        """Where the engine process's last words are, when it left any."""
        path = self._log_path
        try:
            return f" (its log: {path})" if path is not None and path.stat().st_size else ""
        except OSError:
            return ""

    # -- the backend face

    def _start(self, name: str, args: tuple, on_update: OnUpdate | None) -> ProcessHandle:
        # Registered before it is sent: its first update can come before the call's answer.
        reply = ProcessHandle(self, next(self._keys), on_update)
        self._replies[reply.key] = reply
        try:
            reply.started(*self.call(name, reply.key, *args))
        except BaseException:
            self._replies.pop(reply.key, None)
            raise
        return reply

    def submit(self, messages: list[dict], params, *, previous: Outcome | None = None,
               on_update: OnUpdate | None = None) -> ProcessHandle:
        return self._start("submit", (messages, params, previous), on_update)

    def fork(self, parent: ProcessHandle, params, *, on_update: OnUpdate | None = None) -> ProcessHandle:
        return self._start("fork", (parent.key, params), on_update)

    def prompt_tokens(self, messages: list[dict], previous: Outcome | None = None) -> int:
        return self.call("prompt_tokens", messages, previous)

    def memory(self):
        """The latest picture the engine process sent, and a request for the next: the UI thread never waits on
        it, and what it shows is at most one poll old (and fresh as each reply ends)."""
        if not self._memory_asked and self.failure is None:
            self._memory_asked = True  # before sending: the answer may come (and clear it) before send returns
            self._memory_asked = self.send("memory") and self._memory_asked
        return self._memory

    def shutdown(self) -> None:
        """Stop the engine and its process (killed if it does not end in time)."""
        self._closing = True
        self.send("stop")
        self._wait()
        self._conn.close()
        if self._reader is not threading.current_thread():
            self._reader.join(STOP_TIMEOUT_S)
