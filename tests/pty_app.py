"""The real `pagedchat` app in a subprocess on a pseudo-terminal, for the tests that kill it, hang up on it
or run two of it: keys go in through the terminal, and what it saved is read from its database."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedchat.bench.app_probe import PLACEHOLDER, START, Terminal
from pagedchat.bench.app_probe import wait_until as wait_until_or_timeout
from pagedchat.tui.store import DB_NAME

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
    """As the probe's, failing the test rather than raising TimeoutError."""
    try:
        return wait_until_or_timeout(condition, what, timeout, every, nudge)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


class AppProcess(Terminal):
    """`pagedchat --model MODEL ...` on its own terminal (120x40), with the data and config dirs given."""

    def __init__(self, model: Path, data_dir: Path, config_dir: Path, *, max_tokens: int, cwd: Path) -> None:
        self.data_dir = data_dir
        env = dict(os.environ, PAGEDCHAT_DATA_DIR=str(data_dir), PAGEDCHAT_CONFIG_DIR=str(config_dir))
        args = [sys.executable, "-c", START, "--model", str(model), "--kv-cache-memory", "4MiB",
                "--dtype", "float32", "--threads", "1", "--temperature", "0", "--max-tokens", str(max_tokens)]
        super().__init__(args, env, cwd)

    def engine_pid(self) -> int:
        """The app's engine process (backends/process.py): its child that runs engine_process."""
        def find() -> int | None:
            for entry in Path("/proc").iterdir():
                try:
                    stat = (entry / "stat").read_text()
                    command = (entry / "cmdline").read_bytes()
                except (OSError, ValueError):  # not a process, or one that just ended
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.pid and b"engine_process" in command:
                    return int(entry.name)
            return None

        return wait_until(find, "the app's engine process")

    def shows(self, text: str, since: int = 0) -> bool:
        """The text was drawn, in one piece, after `since` (a `received` taken earlier; output keeps its last
        200,000 bytes, so this is for short waits)."""
        return self.shown_since(since, text)

    def send(self, text: str) -> None:
        """Type a message and press Enter until it shows up saved (the model may still be loading)."""
        wait_until(lambda: PLACEHOLDER in self.output, "the app to show its input")
        before = len([m for m in saved(self.data_dir) if m.role == "user"])
        time.sleep(0.3)  # focus arrives just after the first paint
        self.type(text)
        wait_until(lambda: len([m for m in saved(self.data_dir) if m.role == "user"]) > before,
                   f"the app to send {text!r}", nudge=lambda: self.type("\r"))
