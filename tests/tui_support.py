"""Helpers for the app tests: configs on temporary dirs, a stand-in backend, waiting on conditions, reading
the screen."""

from __future__ import annotations

import html
import os
import queue
import re
import signal
import threading
from types import SimpleNamespace
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import pytest
import textual.app
import textual.pilot
from textual._wait import wait_for_idle

from pagedchat.backends.base import BackendInfo, MemoryView
from pagedchat.backends.local import LocalBackend
from pagedchat.config import AppConfig, load_config
from pagedchat.engine.records import FinishReason
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.conversation import ChatSettings
from pagedchat.errors import PagedChatError
from pagedchat.model import families

WAIT_S = 30.0


@pytest.fixture(autouse=True)
def quick_pilot(monkeypatch):
    """Pilot waits after each key until the process looks idle, i.e. up to 1 s while the engine thread
    computes. The app tests wait on explicit conditions instead, so cap that wait: a test module that imports
    this fixture uses it for every test."""
    quick = partial(wait_for_idle, max_sleep=0.05)
    monkeypatch.setattr(textual.app, "wait_for_idle", quick)
    monkeypatch.setattr(textual.pilot, "wait_for_idle", quick)


def make_config(tmp: Path, model: Path | str | None = None, **overrides) -> AppConfig:
    """An AppConfig whose config and data dirs live under tmp; greedy sampling so runs repeat. float32 by name:
    the app's engine runs in a process of its own, which the tests' fp32 default (conftest) does not reach. No
    speculation: the tests watch replies live, and drafts would end a tiny model's repetitive reply at once."""
    defaults = dict(config_dir=tmp / "config", data_dir=tmp / "data", model=str(model) if model else None,
                    kv_cache_memory="4MiB", temperature=0.0, top_p=1.0, max_tokens=48, dtype="float32",
                    speculative="off")
    defaults.update(overrides)
    (tmp / "config").mkdir(parents=True, exist_ok=True)
    return load_config(None, **defaults)


async def wait_for(pilot, condition, what: str = "condition", timeout: float = WAIT_S) -> None:
    """Let the app run until condition() holds; fail after timeout seconds (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            app = pilot.app
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (focused: {app.focused!r}; "
                                 f"screen: {app.screen!r}; the app's exception: {app._exception!r})")
        await pilot.pause(0.01)


def notices(app) -> list[str]:
    """The notifications the app has up now, oldest first, as their text. Read from Textual's own record: it
    has no public accessor, and the toasts are not drawn under run_test unless asked for."""
    return [n.message for n in app._notifications]


async def send(pilot, text: str, max_tokens: int | None = None):
    """Type into the active chat's input and press Enter; returns the chat's session."""
    app = pilot.app
    session = app.active_session
    if max_tokens is not None:
        session.record.settings = ChatSettings(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
    prompt = app.chat_view(session).prompt
    prompt.focus()
    prompt.text = text
    said = len(notices(app))
    await pilot.press("enter")
    # Handled: the input is cleared once the reply has started, or a notice says why it did not.
    await wait_for(pilot, lambda: not prompt.text or len(notices(app)) > said, "the message to be handled")
    return session


def scripted_app(tmp_path: Path, replies=(), chunks: int = 3) -> PagedChatApp:
    """The app over a ScriptedEngine (in this process) that writes `replies` in turn."""
    engine = ScriptedEngine(list(replies), chunks=chunks)
    return PagedChatApp(make_config(tmp_path), backend_factory=lambda progress: LocalBackend(engine))


async def chat_once(pilot, text: str):
    """Send text from the active chat's input and wait for the scripted reply to finish; returns the session."""
    app = pilot.app
    await wait_for(pilot, lambda: app.backend is not None, "the engine")
    session = app.active_session
    prompt = app.active_chat.prompt
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == 2, "the reply")
    await pilot.pause()
    return session


class EngineHold:
    """Freezes the app's engine process (SIGSTOP) as the next reply's first update reaches the app, so that the
    reply is still running when the test next acts, however long Pilot takes: a reply of LONG tokens takes about
    half a second in the engine's own process, and a key press can wait as long for the tabs' underline
    animation. release() lets the engine go on (SIGCONT), and so does the app shutting it down (which would
    otherwise kill it, as a process that stopped answering). Make it after ready(), before the send; the app
    waits on no call to the engine meanwhile (tests/tui/test_engine_stall.py holds one far longer)."""

    def __init__(self, app) -> None:
        self.backend = app.backend
        self._lock = threading.Lock()
        self._stopped = self._released = False
        put, shutdown = app.inbox.put, self.backend.shutdown

        def put_first_stops(chat_id, update) -> None:  # the app's reader thread, before the UI hears of it
            with self._lock:
                if not self._stopped and not self._released:
                    os.kill(self.backend.pid, signal.SIGSTOP)
                    self._stopped = True
            put(chat_id, update)

        def shutdown_released() -> None:
            self.release()
            shutdown()

        app.inbox.put = put_first_stops
        self.backend.shutdown = shutdown_released

    def release(self) -> None:
        with self._lock:
            if self._stopped and not self._released:
                os.kill(self.backend.pid, signal.SIGCONT)
            self._released = True


class EngineThrottle:
    """Slows the app's engine process to a tenth or so of its speed by stopping it most of the time (SIGSTOP for
    STOPPED_S, SIGCONT for RUNNING_S), so that two replies overlap however fast the machine decodes, while every
    call the app makes is still answered within a few tens of milliseconds. stop() leaves it running."""

    STOPPED_S, RUNNING_S = 0.02, 0.002

    def __init__(self, app) -> None:
        self.pid = app.backend.pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.STOPPED_S)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.RUNNING_S)
        except ProcessLookupError:  # the app shut its engine down
            pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


SVG_CELL = re.compile(r'<text [^>]*?x="([\d.]+)"[^>]*?-line-(\d+)\)">(.*?)</text>', re.S)
SVG_CHAR_WIDTH = 12.2   # Textual's screenshot: 0.61 of its 20-pixel font per cell


def screen_text(app) -> str:
    """The screen as plain text, for asserting on what the user sees (read from Textual's own screenshot)."""
    rows: dict[int, dict[int, str]] = {}
    for x, line, text in SVG_CELL.findall(app.export_screenshot()):
        rows.setdefault(int(line), {})[round(float(x) / SVG_CHAR_WIDTH)] = html.unescape(text).replace("\xa0", " ")
    lines = []
    for n in sorted(rows):
        line = ""
        for column in sorted(rows[n]):
            line = line.ljust(column) + rows[n][column].rstrip("\n")
        lines.append(line)
    return "\n".join(lines)


def static_text(app, selector: str) -> str:
    """The plain text a Static (or Label) shows."""
    content = app.query_one(selector).content
    return getattr(content, "plain", str(content))


class StandInBackend:
    """The backend face with no model behind it: a fixed picture of memory, and no replies (submit refuses).
    For screens that must not move, such as the snapshot tests."""

    failure = None
    core_loan = None

    def __init__(self, memory: Callable[[], MemoryView], info: BackendInfo) -> None:
        self.memory_view = memory
        self.info = info

    def submit(self, messages, params, *, previous=None, on_update=None):
        raise PagedChatError("the stand-in backend writes no replies")

    def prompt_tokens(self, messages, previous=None) -> None:
        return None   # no tokenizer behind it: the context figure comes from saved stats alone

    def fork(self, parent, params, *, on_update=None):
        raise PagedChatError("the stand-in backend writes no replies")

    def memory(self) -> MemoryView:
        return self.memory_view()

    def stalled_for(self) -> None:
        return None

    def shutdown(self) -> None:
        pass



class ScriptedEngine:
    """A stand-in for Engine in app and CLI tests: each reply is the next scripted text, streamed from a thread of
    its own in a few updates, the way the engine's compute thread calls on_update. No model runs. Use it where a
    test needs exact model output (markup, escape sequences) that a random tiny model cannot be made to write.
    A reply given as (text, error) streams text, then fails with that error.
    """

    block_size = 16
    model_path = "scripted-model"
    device = "cpu"
    dtype = "float32"
    config = SimpleNamespace(max_position_embeddings=2048, vocab_size=320,
                             family=families.of_architecture("LlamaForCausalLM"))
    cache_plan = SimpleNamespace(num_pages=4, page_bytes=1024, groups=())
    model = SimpleNamespace(weight_precision="float32")

    def __init__(self, replies: list[str | tuple[str, str]], chunks: int = 3, first_token_s: float = 0.0) -> None:
        from tiny_models import make_tokenizer

        self.tokenizer = make_tokenizer()   # a real chat template, so the app builds its prompts as usual
        self.replies = list(replies)
        self.chunks = chunks
        self.first_token_s = first_token_s   # how long each reply thinks before its first text (a long prefill)
        self.prompts: list[list[int]] = []  # every submitted prompt, in order
        self.params: list = []              # and its SamplingParams
        self.failure: str | None = None     # as Engine.failure: a test sets it to stop the engine
        self.cancelled: set[str] = set()
        self.count = 0

    def submit(self, prompt, params=None, *, on_update=None, request_id=None) -> ScriptedHandle:
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif prompt and isinstance(prompt[0], dict):
            from pagedchat.engine.chat_template import chat_prompt_ids

            prompt = chat_prompt_ids(self.tokenizer, prompt)
        self.count += 1
        rid = request_id or f"scripted-{self.count}"
        handle = ScriptedHandle(rid, list(prompt), on_update, engine=self)
        self.prompts.append(handle.prompt_token_ids)
        self.params.append(params)
        reply = self.replies.pop(0) if self.replies else ""
        text, error = reply if isinstance(reply, tuple) else (reply, None)
        threading.Thread(target=self.stream, args=(handle, text, error), daemon=True).start()
        return handle

    def stream(self, handle: ScriptedHandle, text: str, error: str | None) -> None:
        from pagedchat.engine.records import Outcome, Update

        step = max(1, -(-len(text) // self.chunks))
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        sent: list[str] = []
        thinking_until = time.monotonic() + self.first_token_s
        while time.monotonic() < thinking_until and handle.request_id not in self.cancelled:
            time.sleep(0.01)
        for i, piece in enumerate(pieces):
            if handle.request_id in self.cancelled:
                break
            time.sleep(0.02)
            sent.append(piece)
            handle.deliver(Update(handle.request_id, piece, 1, (i,)))
        reason = (FinishReason.CANCELLED if handle.request_id in self.cancelled
                  else FinishReason.ERROR if error else FinishReason.STOP)
        done = Outcome(handle.request_id, "".join(sent), reason, error, prompt_tokens=len(handle.prompt_token_ids),
                       generated_tokens=len(sent), time_to_first_token=0.02, decode_tokens_per_s=50.0,
                       prompt_token_ids=handle.prompt_token_ids, token_ids=list(range(len(sent))))
        handle.deliver(Update(handle.request_id, outcome=done))

    def fork(self, request_id, params=None, *, on_update=None):
        from pagedchat.errors import RequestError

        raise RequestError("the scripted engine does not fork")

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)

    def memory(self):
        from pagedchat.engine.pages import MemoryCounters
        from pagedchat.engine.records import PageState
        from pagedchat.engine.kv_snapshot import MemorySnapshot

        return MemorySnapshot(num_pages=4, free_pages=4, cached_pages=0, block_size=self.block_size,
                              page_bytes=1024, ref_counts={}, page_states=[PageState.FREE] * 4,
                              shared_pages={}, seqs={}, cpu_total=0, cpu_cached=0, cpu_swapped=0,
                              counters=MemoryCounters(), hit_rate=0.0, recent_hit_rate=0.0, live_tokens=0,
                              contiguous_bytes=0)

    def shutdown(self) -> None:
        self.cancelled.update(f"scripted-{i}" for i in range(1, self.count + 1))


@dataclass(eq=False)
class ScriptedHandle:
    """What the app and `ask` use of a RequestHandle: a ReplyHandle (engine/records.py) and its iteration."""

    request_id: str
    prompt_token_ids: list[int]
    on_update: object = None
    engine: object = None
    updates: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    outcome: object = None
    finished: threading.Event = field(default_factory=threading.Event)

    def deliver(self, update) -> None:
        if update.finished:
            self.outcome = update.outcome
        self.updates.put(update)
        if self.on_update is not None:
            self.on_update(update)
        if update.finished:
            self.finished.set()

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)

    def so_far(self):
        from pagedchat.engine.records import Outcome

        return self.outcome or Outcome(self.request_id, prompt_tokens=len(self.prompt_token_ids))

    def __iter__(self):
        while True:
            update = self.updates.get(timeout=WAIT_S)
            yield update
            if update.finished:
                return

    def result(self, timeout: float | None = WAIT_S):
        if not self.finished.wait(timeout):
            raise TimeoutError(f"{self.request_id} still running")
        return self.outcome
