"""The SQLite layer under the store: one connection's settings, which errors mean a damaged file, and a
row as a record. A leaf, so that both the store and its salvage (`salvage.py`) build on it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from pagedchat.engine.records import Outcome
from pagedchat.tui.conversation import ChatMessage, stats_from_dict, stats_to_dict

# How long a write waits for another instance's transaction (a few ms each) before it counts as failed and
# is retried later. It blocks the UI thread while it waits, so it stays short.
BUSY_TIMEOUT_S = 2.0
ROLES = ("user", "assistant")

# SQLite's primary result codes (the low byte of an extended code) that mean the file itself is damaged.
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26


class Damaged(Exception):
    """The database is damaged: its rows cannot all be read."""


# What decoding a row that is not what we wrote raises (bad JSON, a list for a dict, an unknown role).
DECODE_ERRORS = (Damaged, ValueError, TypeError, KeyError, AttributeError)


def is_damage(exc: BaseException) -> bool:
    """True for errors that say the file is damaged; False for busy, locked, read-only, full, I/O errors."""
    if isinstance(exc, DECODE_ERRORS):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.DatabaseError) and code is not None and code & 0xFF in (SQLITE_CORRUPT,
                                                                                           SQLITE_NOTADB)


def describe(exc: BaseException) -> str:
    """One line for the user: SQLite's words, with what "locked" means here."""
    text = str(exc).strip() or type(exc).__name__
    if "locked" in text or "busy" in text:
        return f"{text}: another program (another pagedchat?) is holding chats.db"
    return text


def connect(path: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S, *, uri: bool = False) -> sqlite3.Connection:
    # Autocommit: transactions are explicit (Store.transaction, migrate), so none is left open by accident
    # holding the write lock against another instance.
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, uri=uri)
    conn.execute("PRAGMA foreign_keys = ON")
    # No memory-mapped I/O (a build may default to some): a page the file system cannot back reaches the
    # process as SIGBUS, where plain reads and writes fail with an error the saver reports and retries.
    conn.execute("PRAGMA mmap_size = 0")
    return conn


def use_rollback_journal(conn: sqlite3.Connection) -> None:
    """A rollback journal, not WAL. WAL maps its -shm index into memory whatever mmap_size says, and a write to
    that mapping once the file cannot be written (made immutable, a file system gone read-only) kills the
    process with SIGBUS. A rollback journal is plain file I/O: the same fault is an error, and the saver's notice
    and retry. Instances still share the file: a writer's lock lasts one short transaction, waited out by the
    busy timeout. Persistent, so a file an older pagedchat left in WAL mode is switched back here."""
    try:
        conn.execute("PRAGMA journal_mode = DELETE")
    except sqlite3.OperationalError:
        pass  # another program holds it open in WAL mode: switched at a later start, when none does


def decode_message(role, content, stats, message_id) -> ChatMessage:
    """A messages row as a ChatMessage; ValueError/TypeError for a row that is not one."""
    if role not in ROLES or not isinstance(content, str) or not isinstance(message_id, str):
        raise ValueError(f"not a chat message: role {role!r}")
    return ChatMessage(role, content, stats_from_dict(json.loads(stats) if stats else None), message_id)


def encode_stats(stats: Outcome | None) -> str | None:
    return json.dumps(stats_to_dict(stats)) if stats is not None else None
