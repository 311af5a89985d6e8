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
import queue
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagedchat import interpreter
from pagedchat.backends.base import BackendInfo, OnUpdate, Progress
from pagedchat.engine.core_loan import CoreLoan
from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.errors import PagedChatError

CALL_TIMEOUT_S = 30.0     # a call waited on (prompt_tokens) that the engine process does not answer in this long fails
STOP_TIMEOUT_S = 10.0     # a process that does not end this long after its stop is killed
# The engine process sends something at least every engine_process.HEARTBEAT_S (0.5 s): this long without a
# word, it has stopped answering (SIGSTOP, a machine swapping or starved of CPU).
STALL_S = 1.5
WAIT_SLICE_S = 0.05       # how often a wait for the process to end checks whether it still answers


class ProcessHandle:
    """One reply in the engine process, followed here from the updates it sends. It exists before the engine
    process has answered the call that starts it (the app never waits on that answer): a refusal then ends it
    with one error update, and `refusal` says why."""

    def __init__(self, backend: "ProcessBackend", key: int, on_update: OnUpdate | None) -> None:
        self._backend = backend
        self.key = key
        self.request_id = f"pending-{key}"   # until the engine's own id comes: never one of the engine's
        self.refusal: PagedChatError | None = None
        self._on_update = on_update
        self._text: list[str] = []
        self._tokens = 0
        self._final: Outcome | None = None
        self._figures: Outcome | None = None   # so far, as the engine process last sent them
        self._done = threading.Event()

    def started(self, request_id: str, figures: Outcome) -> None:
        """The call's answer; its updates may have come first, with newer figures."""
        self.request_id, self._figures = request_id, self._figures or figures

    def refuse(self, error: PagedChatError) -> None:
        """The engine process would not start it (too long, bad settings), or went before it answered."""
        self.refusal = error
        self.end(str(error))

    def deliver(self, update: Update, figures: Outcome | None = None) -> None:
        """The reader thread: pass it on, and keep what an ending without the engine needs."""
        if self._final is not None:   # ended already (refused, then the process went too)
            return
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
            raise TimeoutError(f"no outcome for {self.request_id} within {timeout} s")
        return self._final


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"the engine process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the engine process was killed by signal {-code}"
    return f"the engine process exited (code {code})"


def start_process(log_path: Path | None) -> tuple[subprocess.Popen, Connection, CoreLoan]:
    """A fresh interpreter running engine_process.main, our end of the socket pair to it, and the page through
    which the app borrows a core from it (engine/core_loan.py). Not a fork (the app's threads would be copied
    mid-flight) nor multiprocessing's spawn (which runs the caller's main script again). Its own session: the
    terminal's signals are the app's, and the process ends when its socket closes."""
    ours, theirs = socket.socketpair()
    loan, page = CoreLoan.create()
    log = open_log(log_path)
    try:
        process = subprocess.Popen(interpreter.command("pagedchat.backends.engine_process", "main",
                                                       str(theirs.fileno()), str(page.fileno())),
                                   pass_fds=(theirs.fileno(), page.fileno()), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        theirs.close()
        page.close()
        if log is not subprocess.DEVNULL:
            log.close()
    return process, Connection(ours.detach()), loan


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
    model cannot be loaded or the process dies first.

    The UI thread never waits on the process: messages go out through a writer thread (a stopped process stops
    reading, and a full socket would hold the sender), submit and fork return their handle before the process
    answers, and whether it still answers is `stalled_for()`, from its heartbeat. Only prompt_tokens waits for
    an answer: call it off the UI thread."""

    def __init__(self, options: dict[str, Any], progress: Progress,
                 log_path: Path | None = None) -> None:
        self._log_path = log_path
        self._process, self._conn, self.core_loan = start_process(log_path)
        self._conn.send(options)
        self._keys = itertools.count(1)
        self._calls: dict[int, Future] = {}
        self._replies: dict[int, ProcessHandle] = {}
        self._memory_asked = False
        self._closing = False
        self._cut = False                      # the writer could not send: the process is gone
        self._heard = time.monotonic()         # the process's last message
        self.failure: str | None = None
        self.info, self._memory = self._await_ready(progress)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="pagedchat-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="pagedchat-engine-reader", daemon=True)
        self._writer.start()
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
                self._heard = time.monotonic()
                return rest[0], rest[1]
            else:  # "failed"
                self._wait()
                self._conn.close()
                raise PagedChatError(rest[0])

    @property
    def pid(self) -> int:
        return self._process.pid

    def _quiet_s(self) -> float:
        return time.monotonic() - self._heard

    def stalled_for(self) -> float | None:
        """Seconds since the engine process was last heard, once that is past STALL_S (it is stopped, or starved
        of CPU); None while it answers. A long prefill is not a stall: its heartbeat goes on meanwhile."""
        if self._closing or self.failure is not None:
            return None
        quiet = self._quiet_s()
        return quiet if quiet > STALL_S else None

    def _wait(self) -> int | None:
        """The process's exit code once it ends; killed if it takes longer than STOP_TIMEOUT_S, or as soon as it
        stops answering (a stopped process would never read its stop)."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while True:
            try:
                return self._process.wait(WAIT_SLICE_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline or self._quiet_s() > STALL_S:
                    self._process.kill()
                    return self._process.wait()

    # -- talking to the engine process

    def send(self, *message: Any) -> bool:
        """Send without waiting (the writer thread sends it); False once the process is gone."""
        if self._cut:
            return False
        self._outbox.put(message)
        return True

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the pipe is closed (ValueError: we closed it ourselves)
                self._cut = True
                return

    def _check_open(self) -> None:
        """Raise at once what is known here: no round trip can answer a process that is gone."""
        if self._closing:
            raise PagedChatError("The engine has been shut down.")
        if self.failure is not None or self._cut:
            raise PagedChatError(f"The engine stopped: {self.failure or 'its process is gone'}")

    def _ask(self, name: str, *args: Any) -> Future:
        """Run a LocalBackend method in the engine process: its result or its error completes the future, on
        the reader thread."""
        self._check_open()
        key, future = next(self._keys), Future()
        self._calls[key] = future
        if not self.send("call", key, name, args):
            self._calls.pop(key, None)
            self._check_open()
        return future

    def call(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """_ask, and wait for the answer (its error is raised here). Never on the UI thread."""
        future = self._ask(name, *args)
        try:
            return future.result(timeout)
        except TimeoutError:
            raise PagedChatError(f"The engine process did not answer {name} within {timeout:.0f} s") from None

    def _read(self) -> None:
        while True:
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError):
                break
            self._heard = time.monotonic()
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
        """The process has ended: end every live reply and waiting call with the reason (a reply still waiting
        for its start is refused, so the app can give its message back)."""
        code = self._wait()
        self._cut = True
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
        self._outbox.put(None)   # the writer may be waiting for a message

    def _log_note(self) -> str:
        """Where the engine process's last words are, when it left any."""
        path = self._log_path
        try:
            return f" (its log: {path})" if path is not None and path.stat().st_size else ""
        except OSError:
            return ""

    # -- the backend face

    def _start(self, name: str, args: tuple, on_update: OnUpdate | None) -> ProcessHandle:
        """A reply's handle at once; the call's answer names it, or refuses it, when it comes. Registered before
        it is sent: its first update can come before the call's answer."""
        self._check_open()
        reply = ProcessHandle(self, next(self._keys), on_update)
        self._replies[reply.key] = reply
        try:
            self._ask(name, reply.key, *args).add_done_callback(partial(self._started, reply))
        except BaseException:
            self._replies.pop(reply.key, None)
            raise
        return reply

    def _started(self, reply: ProcessHandle, answer: Future) -> None:
        if answer.exception() is None:
            reply.started(*answer.result())
        elif self._replies.pop(reply.key, None) is not None:   # else the process's end has ended it already
            reply.refuse(answer.exception())

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
        """Stop the engine and its process: killed if it does not end in time, or at once if it has stopped
        answering, so that quitting never waits long on it."""
        self._closing = True
        self.send("stop")
        self._wait()
        self._outbox.put(None)
        for thread in (self._writer, self._reader):
            if thread is not threading.current_thread():
                thread.join(STOP_TIMEOUT_S)
        self._conn.close()
