"""`pagedchat bench --app`: does the chat app keep up with its engine?

The real app runs on a pseudo-terminal (all of its rendering, escape codes written to the terminal), a prompt
is typed into a new chat, and the reply line's tok/s is read from what the app saved. Then the engine alone,
in this process, answers the same conversation with the same parameters. Rounds alternate, as everywhere in
the bench, because the machines are shared.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from pagedchat.bench.config import BenchError
from pagedchat.bench.stats import median
from pagedchat.engine.records import FinishReason

# A reply the default model writes at length: a guide, mostly one long list (the costliest Markdown to grow).
LONG_PROMPT = "Write a long, detailed step-by-step guide to planning a two-week trip to Japan, with many tips."
DEFAULT_MAX_TOKENS = 450
START = "from pagedchat.cli import main; raise SystemExit(main())"
PLACEHOLDER = b"Enter sends"  # the prompt input's placeholder: the app is up and its input shown
SIZE = (40, 120)  # rows, columns
TIMEOUT_S = 300.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = TIMEOUT_S, every: float = 0.05,
               nudge: Callable[[], None] | None = None):
    """Poll condition() until it returns something true; nudge() (if given) runs about once a second."""
    deadline = time.monotonic() + timeout
    last_nudge = 0.0
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        if nudge is not None and time.monotonic() - last_nudge > 1.0:
            nudge()
            last_nudge = time.monotonic()
        time.sleep(every)


class Terminal:
    """A command on its own pseudo-terminal: keys go in, and the screen output is drained as it comes (or
    the program blocks once the terminal's buffer is full)."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        import fcntl
        import termios

        rows, cols = SIZE
        env = dict(env, TERM="xterm-256color", LINES=str(rows), COLUMNS=str(cols))
        self.pid, self.fd = os.forkpty()
        if self.pid == 0:  # the child: never return into the caller
            try:
                os.chdir(cwd)  # not a checkout's root, whose folders would join the path
                os.execve(args[0], args, env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.output = bytearray()
        self.status: int | None = None
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child is gone, or the terminal was closed
                return
            if not chunk:
                return
            self.output += chunk
            del self.output[:-200_000]

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float = 20.0) -> int:
        """The exit code (negative: killed by that signal)."""
        def done():
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            return pid != 0

        wait_until(done, "the program to exit", timeout)
        return self.status

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def screen_tail(self) -> str:
        return self.output[-2000:].decode(errors="replace")


def app_args(model: str | None, max_tokens: int, options: Mapping[str, str]) -> list[str]:
    """`pagedchat` as a user starts it, greedy, with the reply budget and the engine options given."""
    args = [sys.executable, "-c", START, "--temperature", "0", "--max-tokens", str(max_tokens)]
    for name, value in options.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args + (["--model", model] if model else [])


@dataclass(frozen=True)
class ReplyTiming:
    text: str
    prompt_tokens: int
    tokens: int
    tokens_per_s: float


@dataclass(frozen=True)
class AppRound:
    app: ReplyTiming
    engine: ReplyTiming


@dataclass(frozen=True)
class AppReport:
    model: str
    rounds: tuple[AppRound, ...]

    @property
    def ratio(self) -> float:
        """The median round's app tok/s over the engine's."""
        return median([r.app.tokens_per_s / r.engine.tokens_per_s for r in self.rounds])


FINAL = (FinishReason.STOP, FinishReason.LENGTH)   # a probe reply ends so; any other ending is not final yet


def finished_reply(data_dir: Path):
    """The first chat's record once its reply is final (None before: the app saves a streaming reply too).
    Polled while the app writes, so read-only: the probe never migrates, checks or salvages the app's file."""
    from pagedchat.tui.store import DB_NAME, Store

    path = data_dir / DB_NAME
    if not path.exists():
        return None
    store = Store.read_only(path)
    try:
        chats = store.load_chats()
    except sqlite3.OperationalError:  # the app has not made its tables yet
        return None
    finally:
        store.close()
    for chat in chats:
        last = chat.messages[-1] if chat.messages else None
        if last and last.role == "assistant" and last.stats and last.stats.finish_reason in FINAL:
            return chat
    return None


def app_round(model: str | None, prompt: str, max_tokens: int, options: Mapping[str, str]):
    """One reply in a fresh app: (its chat record as saved, the reply line's figures)."""
    with tempfile.TemporaryDirectory(prefix="pagedchat-app-probe-") as tmp:
        data, conf = Path(tmp, "data"), Path(tmp, "config")
        env = dict(os.environ, PAGEDCHAT_DATA_DIR=str(data), PAGEDCHAT_CONFIG_DIR=str(conf))
        term = Terminal(app_args(model, max_tokens, options), env, cwd=Path(tmp))
        try:
            try:
                wait_until(lambda: PLACEHOLDER in term.output, "the app to show its input")
                time.sleep(0.3)  # focus arrives just after the first paint
                term.type(prompt)
                # Enter again until the message is taken (the model may still be loading).
                chat = wait_until(lambda: finished_reply(data), "the reply", nudge=lambda: term.type("\r"))
            except TimeoutError as exc:
                raise BenchError(f"the app probe: {exc}; the screen ended with {term.screen_tail()[-300:]!r}")
            term.signal(signal.SIGTERM)
            term.wait()
        finally:
            term.close()
    last = chat.messages[-1]
    return chat, ReplyTiming(last.content, last.stats.prompt_tokens, last.stats.generated_tokens,
                             last.stats.decode_tokens_per_s or 0.0)


def engine_reply(backend, chat, max_tokens: int) -> ReplyTiming:
    """The same conversation and parameters straight into the engine."""
    from pagedchat.engine.params import SamplingParams

    messages = chat.conversation(upto=len(chat.messages) - 1)
    outcome = backend.submit(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0)).result()
    if outcome.error:
        raise BenchError(f"the engine alone failed: {outcome.error}")
    return ReplyTiming(outcome.text, outcome.prompt_tokens, outcome.generated_tokens,
                       outcome.decode_tokens_per_s or 0.0)


def run_app_probe(model: str | None, repeat: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                  options: Mapping[str, str] | None = None, prompt: str = LONG_PROMPT,
                  progress: Callable[[str], None] = lambda line: None) -> AppReport:
    """Alternating rounds of the app and the engine alone, one reply each; `options` are Engine keyword
    arguments that are also `pagedchat` flags (kv_cache_memory, dtype, device)."""
    options = dict(options or {})
    from pagedchat.backends.local import LocalBackend
    from pagedchat.engine.engine import Engine

    backend = LocalBackend(Engine(model, **options))
    try:
        rounds = []
        for i in range(repeat):
            chat, app = app_round(model, prompt, max_tokens, options)
            engine = engine_reply(backend, chat, max_tokens)
            # The same prompt, or the two figures do not compare. (The replies may differ at a near-tie in bf16:
            # from the second round on, the engine alone reads the prompt's pages from its prefix cache.)
            if engine.prompt_tokens != app.prompt_tokens:
                raise BenchError(f"the app sent a {app.prompt_tokens}-token prompt, the engine alone "
                                 f"{engine.prompt_tokens}: not the same conversation")
            progress(f"round {i + 1}: app {app.tokens_per_s:.1f} tok/s ({app.tokens} tokens), "
                     f"engine alone {engine.tokens_per_s:.1f} tok/s ({engine.tokens} tokens)")
            rounds.append(AppRound(app, engine))
        return AppReport(backend.info.model, tuple(rounds))
    finally:
        backend.shutdown()
