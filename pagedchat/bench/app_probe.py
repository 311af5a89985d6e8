"""`pagedchat bench --app`: does the chat app keep up with its engine?

The real app runs on a pseudo-terminal (all of its rendering, escape codes written to the terminal), a prompt
is typed into a new chat, and the reply line's tok/s is read from what the app saved. Then the engine alone,
in this process, answers the same conversation with the same parameters. Rounds alternate, as everywhere in
the bench, because the machines are shared.

With tabs > 1, a new tab for each further prompt, typed but not sent; then the tabs are sent one after another, the
last first, so that the replies start within a fraction of a second, as the engine alone's do (it gets all of its
chats at once). Sent as each tab was built, the first reply ran alone, then beside the building of the others, and
a later one's window took in the next one's start: the ratio measured the start more than four tabs generating.
The figure on both sides is the sum of the replies' rates.
While all of them stream (each has shown text, and none has ended), a key is typed in the input now and then,
and the time until the terminal shows it is the key's echo.
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

from pagedchat.bench.options import BenchError
from pagedchat.bench.stats import median
from pagedchat.engine.records import FinishReason

# A reply the default model writes at length: a guide, mostly one long list (the costliest Markdown to grow).
LONG_PROMPT = "Write a long, detailed step-by-step guide to planning a two-week trip to Japan, with many tips."
# The other tabs' prompts: different questions, replies of about the same length.
MORE_PROMPTS = (
    "Write a long, detailed step-by-step guide to learning to cook Italian food at home, with many tips.",
    "Write a long, detailed step-by-step guide to training for a first marathon, with many tips.",
    "Write a long, detailed step-by-step guide to starting a vegetable garden, with many tips.",
)
DEFAULT_MAX_TOKENS = 450
START = "from pagedchat.cli import main; raise SystemExit(main())"
PLACEHOLDER = b"Enter sends"  # the prompt input's placeholder: the app is up and its input shown
NEW_CHAT, PREVIOUS_CHAT, BACKSPACE = "\x0e", "\x1b[5;5~", "\x7f"   # ctrl+n, ctrl+pageup
ECHO_KEY = "\u00a4"   # typed to time its echo: a character no reply writes
ECHO_EVERY_S = 0.25
# How often the app's file is read for the replies' end. The figures are the app's own, so a late look changes
# none of them, while each read takes CPU (and a read lock the app's saves wait on) from the app it measures.
DONE_POLL_S = 0.5
SIZE = (45, 140)  # rows, columns: a real terminal's
TIMEOUT_S = 300.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = TIMEOUT_S, every: float = 0.05,
               nudge: Callable[[], None] | None = None, nudge_every: float = 1.0):
    """Poll condition() until it returns something true; nudge() (if given) runs about every nudge_every s."""
    deadline = time.monotonic() + timeout
    last_nudge = 0.0
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        if nudge is not None and time.monotonic() - last_nudge > nudge_every:
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
        self.received = 0   # bytes read in all, so that a position survives the trimming of output
        self._arrived = threading.Condition()
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
            with self._arrived:
                self.output += chunk
                self.received += len(chunk)
                del self.output[:-200_000]
                self._arrived.notify_all()

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

    def shown_since(self, mark: int, text: str) -> bool:
        """Whether the output from byte `mark` on (as counted by `received`, which the trimming of output leaves
        alone) holds text."""
        with self._arrived:
            return text.encode() in self.output[max(0, len(self.output) - (self.received - mark)):]

    def wait_shown(self, mark: int, text: str, timeout: float) -> bool:
        """Wait until the output from byte `mark` on holds text; False on timeout. Woken by each read, not polled:
        a poll would take CPU from the app it times."""
        with self._arrived:
            return self._arrived.wait_for(lambda: self.shown_since(mark, text), timeout)

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
    """One reply, or with several tabs their sums: tokens and the replies' rates added up."""

    text: str
    prompt_tokens: int
    tokens: int
    tokens_per_s: float


@dataclass(frozen=True)
class AppRound:
    app: ReplyTiming
    engine: ReplyTiming
    echoes_s: tuple[float, ...] = ()   # with several tabs: each typed key's time until the terminal showed it


@dataclass(frozen=True)
class AppReport:
    model: str
    rounds: tuple[AppRound, ...]

    @property
    def ratio(self) -> float:
        """The median round's app tok/s over the engine's."""
        return median([r.app.tokens_per_s / r.engine.tokens_per_s for r in self.rounds])

    @property
    def echoes_s(self) -> list[float]:
        return sorted(e for r in self.rounds for e in r.echoes_s)


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, int(share * len(values) + 0.999999) - 1))]


FINAL = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTEXT_FULL)   # else not final yet


def _chats(data_dir: Path):
    """The app's chats as saved, or None before it has made its file. Polled while the app writes, so
    read-only: the probe never migrates, checks or salvages the app's file."""
    from pagedchat.tui.store import DB_NAME, Store

    path = data_dir / DB_NAME
    if not path.exists():
        return None
    store = Store.read_only(path)
    try:
        return store.load_chats()
    except sqlite3.OperationalError:  # the app has not made its tables yet
        return None
    finally:
        store.close()


def replying(chats) -> list:
    """The chats whose last message is a reply, finished or not (the app saves a streaming reply too)."""
    return [c for c in chats or () if c.messages and c.messages[-1].role == "assistant"]


def streaming(chats) -> list[bool]:
    """Whether each reply has text yet (saved as it streams, twice a second)."""
    return [bool(c.messages[-1].content) for c in replying(chats)]


def finished(chats) -> list:
    return [c for c in replying(chats) if c.messages[-1].stats and c.messages[-1].stats.finish_reason in FINAL]


def finished_reply(data_dir: Path):
    """The first chat's record once its reply is final (None before)."""
    done = finished(_chats(data_dir))
    return done[0] if done else None


def timing(chat) -> ReplyTiming:
    last = chat.messages[-1]
    return ReplyTiming(last.content, last.stats.prompt_tokens, last.stats.generated_tokens,
                       last.stats.decode_tokens_per_s or 0.0)


def added(timings: list[ReplyTiming]) -> ReplyTiming:
    return ReplyTiming("\n\n".join(t.text for t in timings), sum(t.prompt_tokens for t in timings),
                       sum(t.tokens for t in timings), sum(t.tokens_per_s for t in timings))


def app_round(model: str | None, prompts: list[str], max_tokens: int, options: Mapping[str, str]):
    """One reply per prompt, each in a tab of a fresh app: (their chat records as saved, in the prompts'
    order; the reply lines' figures added up; the keys' echo times)."""
    with tempfile.TemporaryDirectory(prefix="pagedchat-app-probe-") as tmp:
        data, conf = Path(tmp, "data"), Path(tmp, "config")
        env = dict(os.environ, PAGEDCHAT_DATA_DIR=str(data), PAGEDCHAT_CONFIG_DIR=str(conf))
        term = Terminal(app_args(model, max_tokens, options), env, cwd=Path(tmp))
        try:
            try:
                chats, echoes = _drive(term, data, prompts)
            except TimeoutError as exc:
                raise BenchError(f"the app probe: {exc}; the screen ended with {term.screen_tail()[-300:]!r}") \
                    from None
            term.signal(signal.SIGTERM)
            term.wait()
        finally:
            term.close()
    order = {prompt: i for i, prompt in enumerate(prompts)}
    chats = sorted(chats, key=lambda c: order.get(c.messages[-2].content, len(order)))
    return chats, added([timing(c) for c in chats]), echoes


def _drive(term: Terminal, data: Path, prompts: list[str]):
    wait_until(lambda: PLACEHOLDER in term.output, "the app to show its input")
    time.sleep(0.3)  # focus arrives just after the first paint
    for count, prompt in enumerate(prompts, 1):
        if count > 1:
            mark = term.received
            term.type(NEW_CHAT)
            if not term.wait_shown(mark, PLACEHOLDER.decode(), TIMEOUT_S):   # the new tab's empty input
                raise TimeoutError("timed out waiting for a new tab")
            time.sleep(0.3)   # focus arrives just after the first paint
        term.type(prompt)
    for count in range(1, len(prompts) + 1):
        if count > 1:
            term.type(PREVIOUS_CHAT)
        # Enter again until the message is taken: the model may still be loading, or the tab just shown not yet
        # have its input focused (an Enter before then is lost).
        wait_until(lambda: len(replying(_chats(data))) >= count, f"reply {count} to start",
                   nudge=lambda: term.type("\r"), nudge_every=0.1 if count > 1 else 1.0)
    # Keys are timed while every tab streams: not before every reply has shown text, nor once one has ended.
    wait_until(lambda: (chats := _chats(data)) and (finished(chats) or all(streaming(chats))), "the replies to stream",
               every=0.1)
    echoes = []
    while len(prompts) > 1 and not finished(_chats(data)):
        echoes.append(echo(term))
        time.sleep(ECHO_EVERY_S)
    return wait_until(lambda: (done := finished(_chats(data))) and len(done) == len(prompts) and done,
                      "the replies", every=DONE_POLL_S), tuple(echoes)


def echo(term: Terminal) -> float:
    """Type a key in the input and time it until the terminal shows it; then take it out again."""
    mark = term.received
    started = time.monotonic()
    term.type(ECHO_KEY)
    if not term.wait_shown(mark, ECHO_KEY, TIMEOUT_S):
        raise TimeoutError("timed out waiting for a typed key to show")
    took = time.monotonic() - started
    term.type(BACKSPACE)
    return took


def engine_replies(backend, chats, max_tokens: int) -> ReplyTiming:
    """The same conversations and parameters straight into the engine, all at once."""
    from pagedchat.engine.params import SamplingParams

    handles = [backend.submit(chat.conversation(upto=len(chat.messages) - 1),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0)) for chat in chats]
    timings = []
    for handle in handles:
        outcome = handle.result()
        if outcome.error:
            raise BenchError(f"the engine alone failed: {outcome.error}")
        timings.append(ReplyTiming(outcome.text, outcome.prompt_tokens, outcome.generated_tokens,
                                   outcome.decode_tokens_per_s or 0.0))
    return added(timings)


def run_app_probe(model: str | None, repeat: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                  options: Mapping[str, str] | None = None, prompt: str = LONG_PROMPT, tabs: int = 1,
                  progress: Callable[[str], None] = lambda line: None) -> AppReport:
    """Alternating rounds of the app and the engine alone, one reply per tab each; `options` are Engine keyword
    arguments that are also `pagedchat` flags (kv_cache_memory, dtype, device)."""
    options = dict(options or {})
    if not 1 <= tabs <= 1 + len(MORE_PROMPTS):
        raise BenchError(f"the app probe runs 1 to {1 + len(MORE_PROMPTS)} tabs, not {tabs}")
    prompts = [prompt, *MORE_PROMPTS[:tabs - 1]]
    from pagedchat.backends.local import LocalBackend
    from pagedchat.engine.engine import Engine

    backend = LocalBackend(Engine(model, **options))
    try:
        rounds = []
        for i in range(repeat):
            chats, app, echoes = app_round(model, prompts, max_tokens, options)
            engine = engine_replies(backend, chats, max_tokens)
            # The same prompts, or the two figures do not compare. (The replies may differ at a near-tie in bf16:
            # from the second round on, the engine alone reads the prompt's pages from its prefix cache.)
            if engine.prompt_tokens != app.prompt_tokens:
                raise BenchError(f"the app sent {app.prompt_tokens} prompt tokens, the engine alone "
                                 f"{engine.prompt_tokens}: not the same conversations")
            echo = f", keys echoed in {percentile(sorted(echoes), 0.95) * 1000:.0f} ms p95" if echoes else ""
            progress(f"round {i + 1}: app {app.tokens_per_s:.1f} tok/s ({app.tokens} tokens), "
                     f"engine alone {engine.tokens_per_s:.1f} tok/s ({engine.tokens} tokens){echo}")
            rounds.append(AppRound(app, engine, echoes))
        return AppReport(backend.info.model, tuple(rounds))
    finally:
        backend.shutdown()
