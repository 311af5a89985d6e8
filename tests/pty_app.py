"""The real `pagedchat` app in a subprocess on a pseudo-terminal, for the tests that kill it, hang up on it
or run two of it: keys go in through the terminal, and what it saved is read from its database."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import fcntl
import termios

from pagedchat.tui.store import DB_NAME

PLACEHOLDER = b"Enter sends"  # the prompt input's placeholder: the app is up and the input shown
START = "from pagedchat.cli import main; raise SystemExit(main())"
WAIT_S = 60.0


@dataclass(frozen=True)
class Saved:
    chat_id: str
    role: str
    content: str
    finish_reason: str | None


def saved(data_dir: Path) -> list[Saved]:
    """Every saved message, in chat and message order; read as another process would (the app may be live)."""
    path = data_dir / DB_NAME
    if not path.exists():
        return []
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    try:
        rows = conn.execute("SELECT chat_id, role, content, stats FROM messages "
                            "ORDER BY chat_id, idx, rowid").fetchall()
    except sqlite3.OperationalError:  # no tables yet
        return []
    finally:
        conn.close()
    return [Saved(c, r, t, json.loads(s).get("finish_reason") if s else None) for c, r, t, s in rows]


def wait_until(condition, what: str, timeout: float = WAIT_S, every: float = 0.05, nudge=None):
    """Poll condition() until it returns something true; nudge() (if given) runs about once a second."""
    deadline = time.monotonic() + timeout
    last_nudge = 0.0
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        if nudge is not None and time.monotonic() - last_nudge > 1.0:
            nudge()
            last_nudge = time.monotonic()
        time.sleep(every)


class AppProcess:
    """`pagedchat --model MODEL ...` on its own terminal (120x40), with the data and config dirs given."""

    def __init__(self, model: Path, data_dir: Path, config_dir: Path, *, max_tokens: int, cwd: Path) -> None:
        self.data_dir = data_dir
        env = dict(os.environ, TERM="xterm-256color", PAGEDCHAT_DATA_DIR=str(data_dir),
                   PAGEDCHAT_CONFIG_DIR=str(config_dir), COLUMNS="120", LINES="40")
        args = [sys.executable, "-c", START, "--model", str(model), "--kv-cache-memory", "4MiB",
                "--dtype", "float32", "--threads", "1", "--temperature", "0", "--max-tokens", str(max_tokens)]
        self.pid, self.fd = os.forkpty()
        if self.pid == 0:  # the child: never return into pytest
            try:
                os.chdir(cwd)  # not the repo root, whose kernels/ folder would shadow the installed package
                os.execve(sys.executable, args, env)
            finally:
                os._exit(127)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.output = bytearray()
        self.status: int | None = None
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        """Read the screen output as it comes, or the app blocks once the terminal's buffer is full."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child is gone, or we closed the terminal
                return
            if not chunk:
                return
            self.output += chunk
            del self.output[:-200_000]

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def send(self, text: str) -> None:
        """Type a message and press Enter until it shows up saved (the model may still be loading)."""
        wait_until(lambda: PLACEHOLDER in self.output, "the app to show its input")
        before = len([m for m in saved(self.data_dir) if m.role == "user"])
        time.sleep(0.3)  # focus arrives just after the first paint
        self.type(text)
        wait_until(lambda: len([m for m in saved(self.data_dir) if m.role == "user"]) > before,
                   f"the app to send {text!r}", nudge=lambda: self.type("\r"))

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def hang_up(self) -> None:
        """Close the terminal, as closing the window does: the kernel sends SIGHUP."""
        os.close(self.fd)
        self.fd = -1

    def wait(self, timeout: float = 20.0) -> int:
        """The exit code (negative: killed by that signal)."""
        def done():
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            return pid != 0

        wait_until(done, "the app to exit", timeout)
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
