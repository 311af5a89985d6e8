"""Recovering what still reads from a damaged chats database.

The damaged file (and its -wal/-shm) is renamed aside and only ever opened read-only, so it stays exactly as
it was for the user or a better tool (`sqlite3 file .recover`). Rows are read one by one by rowid: a damaged
page loses the rows on it, a row that does not decode loses only itself, and every other chat comes back.
Then every table leaf page is read straight from the file's bytes (sqlite_pages.py), which finds the rows SQLite
cannot reach through a damaged or missing interior page (a file cut short).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pagedchat.tui import sqlite_pages
from pagedchat.tui.db import ROLES, connect, decode_message, describe
from pagedchat.tui.conversation import ChatMessage, ChatRecord, ChatSettings, new_message_id

CHAT_COLUMNS = "id, title, system_prompt, settings, position, is_open, created, updated"
MAX_PROBE = 1_000_000  # rowids tried one by one when even the list of rows cannot be read


@dataclass
class Salvage:
    chats: list[ChatRecord] = field(default_factory=list)
    lost_rows: int = 0

    @property
    def messages(self) -> int:
        return sum(len(c.messages) for c in self.chats)


# The Store class, passed in by the store itself, so that this module does not import it back.
S = TypeVar("S")


def rebuild(store_cls: type[S], path: Path, reason: BaseException, busy_timeout_s: float) -> S:
    """Move the damaged file aside, copy what reads into a fresh database at `path`, say what happened."""
    try:
        moved = move_aside(path)
    except OSError as exc:
        return store_cls.in_memory(f"Saved chats in {path} are damaged ({describe(reason)}) and could not be "
                                   f"moved aside ({exc.strerror or exc}); chats in this session will not be kept.")
    found = read_damaged(moved)
    try:
        store = store_cls.open_file(path, busy_timeout_s)
        with store.transaction():
            for chat in found.chats:
                store.put_chat(chat)
                for i, message in enumerate(chat.messages):
                    store.put_message(chat.id, i, message)
    except (sqlite3.Error, OSError) as exc:
        return store_cls.in_memory(f"Saved chats were damaged and a fresh database could not be written "
                                   f"({describe(exc)}); the damaged file is kept untouched as {moved}.")
    lost = f"; {found.lost_rows} damaged rows could not be read" if found.lost_rows else ""
    store.notice = (f"Saved chats were damaged ({describe(reason)}). Recovered {len(found.chats)} chats "
                    f"({found.messages} messages) into a fresh {path.name}{lost}. The damaged file is kept "
                    f"untouched as {moved}.")
    return store


def move_aside(path: Path) -> Path:
    """Rename the database and its SQLite side files to `<name>.corrupt-<time>` (contents untouched)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    path.rename(target)
    for suffix in ("-wal", "-shm", "-journal"):  # the WAL holds committed chats that belong to this file
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    return target


def read_damaged(path: Path) -> Salvage:
    scanned = Scanned.of(sqlite_pages.read_rows(path))
    try:
        conn = connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return _read(None, scanned)
    try:
        return _read(conn, scanned)
    finally:
        conn.close()


@dataclass(frozen=True)
class Scanned:
    """The rows found on the file's pages, told apart by their shape (the current schema's columns)."""

    chats: list[tuple[int, tuple]]
    messages: list[tuple[int, tuple]]

    @classmethod
    def of(cls, rows: list[sqlite_pages.Row]) -> Scanned:
        chats, messages = [], []
        for row in rows:
            v = row.values
            if len(v) == 8 and all(isinstance(x, str) for x in v[:4]) and v[3].startswith("{"):
                # REAL columns holding whole numbers are stored as integers on disk
                times = tuple(float(t) if isinstance(t, int) else t for t in v[6:])
                chats.append((row.rowid, v[:6] + times))
            elif (len(v) == 7 and v[0] is None and isinstance(v[1], str) and isinstance(v[2], str)
                  and isinstance(v[3], int) and v[4] in ROLES and isinstance(v[5], str)):
                chat_id, message_id, idx, role, content, stats = v[1:]
                messages.append((row.rowid, (chat_id, idx, role, content, stats, message_id)))
        return cls(chats, messages)


def _with_scanned(read: list[tuple[int, tuple]], lost: int,
                  scanned: list[tuple[int, tuple]]) -> tuple[list[tuple[int, tuple]], int]:
    """The rows SQLite read, plus those only the page scan found; each one found counts one fewer lost."""
    have = {rowid for rowid, _ in read}
    extra = [(rowid, row) for rowid, row in scanned if rowid not in have]
    return sorted(read + extra, key=lambda r: r[0]), max(0, lost - len(extra))


def _read(conn: sqlite3.Connection | None, scanned: Scanned) -> Salvage:
    out = Salvage()
    chats: dict[str, ChatRecord] = {}
    rows, lost = _rows(conn, "chats", CHAT_COLUMNS) if conn is not None else ([], 0)
    rows, lost = _with_scanned(rows, lost, scanned.chats)
    out.lost_rows += lost
    for _, row in rows:
        chat = _chat(row)
        if chat is None:
            out.lost_rows += 1
        else:
            chats[chat.id] = chat
    if conn is not None:
        id_column = "id" if "id" in _columns(conn, "messages") else "NULL"
        rows, lost = _rows(conn, "messages", f"chat_id, idx, role, content, stats, {id_column}")
    else:
        rows, lost = [], 0
    rows, lost = _with_scanned(rows, lost, scanned.messages)
    out.lost_rows += lost
    placed: dict[str, list[tuple[int, int, ChatMessage]]] = {}
    for rowid, (chat_id, idx, role, content, stats, message_id) in rows:
        try:
            message = decode_message(role, content, stats, message_id or new_message_id())
            order = (int(idx), rowid)
        except (ValueError, TypeError):
            out.lost_rows += 1
            continue
        if isinstance(chat_id, str):
            placed.setdefault(chat_id, []).append((*order, message))
    for chat_id, found in placed.items():
        # Messages whose chat row was lost still come back, in a chat of their own.
        chat = chats.setdefault(chat_id, ChatRecord(id=chat_id, title="Recovered chat", position=len(chats)))
        chat.messages = [m for _, _, m in sorted(found, key=lambda t: t[:2])]
    out.chats = list(chats.values())
    return out


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    try:
        return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    except sqlite3.DatabaseError:
        return set()


def _rows(conn: sqlite3.Connection, table: str, columns: str) -> tuple[list[tuple[int, tuple]], int]:
    """(rowid, row) for every row of `table` that reads, and how many did not."""
    try:
        rowids = [r[0] for r in conn.execute(f"SELECT rowid FROM {table} ORDER BY rowid")]
    except sqlite3.DatabaseError:
        rowids = _probe_range(conn, table)
    rows, lost = [], 0
    for rowid in rowids:
        try:
            row = conn.execute(f"SELECT {columns} FROM {table} WHERE rowid = ?", (rowid,)).fetchone()
        except sqlite3.DatabaseError:
            lost += 1
            continue
        if row is not None:
            rows.append((rowid, row))
    return rows, lost


def _probe_range(conn: sqlite3.Connection, table: str) -> list[int]:
    try:
        top = conn.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0]
    except sqlite3.DatabaseError:
        return []
    return list(range(1, min(int(top or 0), MAX_PROBE) + 1))


def _chat(row: tuple) -> ChatRecord | None:
    cid, title, system, settings, position, is_open, created, updated = row
    if not isinstance(cid, str):
        return None
    try:
        parsed = ChatSettings.from_dict(json.loads(settings))
    except (ValueError, TypeError, AttributeError):
        parsed = ChatSettings()  # the chat's words matter more than its sampling settings
    now = time.time()
    return ChatRecord(id=cid, title=title if isinstance(title, str) else "Recovered chat",
                      system_prompt=system if isinstance(system, str) else "", settings=parsed,
                      position=position if isinstance(position, int) else 0, is_open=bool(is_open),
                      created=created if isinstance(created, float) else now,
                      updated=updated if isinstance(updated, float) else now)
