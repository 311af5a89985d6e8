"""Saved chats in SQLite (`chats.db` in the data dir).

Small and synchronous on purpose: a write is one short transaction on the UI thread. The file is shared:
several pagedchat instances may keep it open at once. A rollback journal (not WAL, whose memory-mapped index
turns an unwritable file into SIGBUS: db.use_rollback_journal) and a busy timeout make a writer wait its
turn, and every save upserts single messages by id, so no instance ever
rewrites (and so deletes) what another wrote. What is refused or salvaged, and why:

- "busy"/"locked", read-only, a missing permission: not damage. The file is left exactly as it is.
- a file from a newer pagedchat: refused before anything is written to it.
- real damage (not a database, failed integrity check, rows that do not decode): the file is renamed aside
  untouched and every row that still reads is copied into a fresh database (`salvage.py`).
"""

from __future__ import annotations

import json
import sqlite3
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pagedchat.tui.db import (BUSY_TIMEOUT_S, DECODE_ERRORS, ROLES, Damaged, connect, decode_message, describe,
                               encode_stats, is_damage, use_rollback_journal)
from pagedchat.tui.migrations import SCHEMA_VERSION, NewerSchema, migrate, schema_version
from pagedchat.tui.conversation import MATCH_CLOSE, MATCH_OPEN, ChatMessage, ChatRecord, ChatSettings, SearchHit

DB_NAME = "chats.db"
MEMORY = Path(":memory:")
EMPTY_GRACE_S = 5.0  # a 0-byte file younger than this is another instance's, created an instant before its tables
SNIPPET_TOKENS = 12  # words of context FTS5 shows around a match


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query: each quoted (so `"`, `-`, `AND` or `*` typed are only text), all
    required, the last also matching as a prefix."""
    words = text.split()
    if not words:
        return ""
    quoted = ['"' + w.replace('"', '""') + '"' for w in words]
    return " ".join(quoted) + "*"


def not_a_file(path: Path) -> str | None:
    """What the path (or what its symlink points at) is, if it exists and is not a regular file: SQLite would
    open a device or a pipe, and write its journal beside it (a link to /dev/null made /dev/null-journal)."""
    try:
        mode = path.stat().st_mode
    except OSError:   # missing (it is created), or unreachable: SQLite's own error says why
        return None
    if stat.S_ISREG(mode):
        return None
    kind = "a folder" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
        "a pipe or socket"
    return f"{kind} ({path.resolve()})" if path.is_symlink() else kind


def is_left_empty(path: Path) -> bool:
    """A 0-byte file nobody is creating: SQLite would open it as an empty database, and the chats it once held
    would vanish without a word."""
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_size == 0 and time.time() - info.st_mtime > EMPTY_GRACE_S


def decode_settings(saved) -> ChatSettings:
    return ChatSettings.from_dict(json.loads(saved))


class Store:
    """The chats database. Use Store.open(); `notice` says what happened at open, if the user should know."""

    def __init__(self, conn: sqlite3.Connection, path: Path, notice: str | None = None):
        self.conn = conn
        self.path = path
        self.notice = notice

    # ---- opening -----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, data_dir: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Store:
        """Open (creating or migrating) the data dir's database. Never raises for a bad or busy file: the
        returned store is then in memory or salvaged, and `notice` says what happened."""
        from pagedchat.tui import salvage  # only needed when a file is damaged

        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / DB_NAME
        if (kind := not_a_file(path)) is not None:
            return cls.in_memory(f"Saved chats in {path} cannot be used: it is {kind}, not a file. It is left as it "
                                 "is; chats in this session will not be kept.")
        if is_left_empty(path):
            return salvage.rebuild(cls, path, Damaged("the file is empty, 0 bytes"), busy_timeout_s)
        try:
            return cls.open_file(path, busy_timeout_s)
        except NewerSchema as exc:
            return cls.in_memory(f"Saved chats in {path} were {exc}; they are left untouched. Update pagedchat "
                                 "to see them; chats in this session will not be kept.")
        except sqlite3.Error as exc:
            if not is_damage(exc):
                return cls.in_memory(f"Saved chats in {path} cannot be opened ({describe(exc)}); the file is "
                                     "left as it is and chats in this session will not be kept.")
            reason = exc
        except DECODE_ERRORS as exc:
            reason = exc
        return salvage.rebuild(cls, path, reason, busy_timeout_s)

    @classmethod
    def open_file(cls, path: Path, busy_timeout_s: float) -> Store:
        conn = connect(path, busy_timeout_s)
        try:
            version = schema_version(conn)  # a read: nothing, not even the journal switch, touches a newer file
            if version > SCHEMA_VERSION:
                raise NewerSchema(version)
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise Damaged(f"integrity check failed: {check[0] if check else 'no answer'}")
            use_rollback_journal(conn)
            migrate(conn)
            store = cls(conn, path)
            store.check_rows()  # a bad row shows up now, not mid-session
            return store
        except BaseException:
            conn.close()  # or the file stays open and cannot be renamed aside on Windows
            raise

    @classmethod
    def read_only(cls, path: Path) -> Store:
        """The file as another process reads it while an app may be writing it: never created, migrated,
        checked or salvaged from outside. Reads raise sqlite3.OperationalError before the app made its tables."""
        return cls(connect(f"{path.resolve().as_uri()}?mode=ro", uri=True), path)

    @classmethod
    def in_memory(cls, notice: str | None = None) -> Store:
        """A throwaway store, for when the data dir cannot be used: the app still runs, nothing is kept."""
        conn = connect(":memory:")
        migrate(conn)
        return cls(conn, MEMORY, notice)

    @property
    def keeps_chats(self) -> bool:
        """False for the throwaway store in memory (Store.in_memory): nothing written to it outlives the process."""
        return self.path != MEMORY

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def busy_timeout(self, seconds: float) -> Iterator[None]:
        """Wait at most `seconds` for another writer's lock inside this block."""
        before = self.conn.execute("PRAGMA busy_timeout").fetchone()[0]
        self.conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")
        try:
            yield
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {before}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; BEGIN IMMEDIATE waits (busy timeout) for the write lock up front, so a
        transaction never fails half-way for want of it."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # ---- reading -----------------------------------------------------------------------------------------
    def load_chats(self, *, open_only: bool | None = None) -> list[ChatRecord]:
        """Chats in tab order (closed ones last, newest first). open_only: True open, False closed, None all."""
        rows = self.conn.execute(
            "SELECT id, title, system_prompt, settings, position, is_open, created, updated FROM chats "
            "ORDER BY is_open DESC, CASE WHEN is_open THEN position ELSE -updated END").fetchall()
        chats = []
        for cid, title, system, settings, position, is_open, created, updated in rows:
            if open_only is not None and bool(is_open) != open_only:
                continue
            chats.append(ChatRecord(id=cid, title=title, system_prompt=system, settings=decode_settings(settings),
                                    messages=self.messages(cid), position=position, is_open=bool(is_open),
                                    created=created, updated=updated))
        return chats

    def check_rows(self) -> None:
        """Raise what loading every chat would for a row that is not what we wrote (DECODE_ERRORS), without
        building every record: SQLite checks each message's role and types, and only saved JSON is decoded
        here. A long chat's start then reads its messages once, not twice."""
        roles = ", ".join("?" * len(ROLES))
        suspects = self.conn.execute(
            f"SELECT role, content, stats, id FROM messages WHERE stats IS NOT NULL OR typeof(role) != 'text' "
            f"OR role NOT IN ({roles}) OR typeof(content) != 'text' OR typeof(id) != 'text'", ROLES)
        for row in suspects:
            decode_message(*row)
        for (settings,) in self.conn.execute("SELECT settings FROM chats"):
            decode_settings(settings)

    def load_chat(self, chat_id: str) -> ChatRecord | None:
        return next((r for r in self.load_chats() if r.id == chat_id), None)

    def messages(self, chat_id: str) -> list[ChatMessage]:
        rows = self.conn.execute("SELECT role, content, stats, id FROM messages WHERE chat_id = ? "
                                 "ORDER BY idx, seq", (chat_id,)).fetchall()
        return [decode_message(*row) for row in rows]

    def closed_chats(self, limit: int = 20) -> list[tuple[str, str, int]]:
        """(id, title, message count) of closed chats, newest first; cheap enough for every palette opening."""
        return self.conn.execute(
            "SELECT c.id, c.title, (SELECT count(*) FROM messages m WHERE m.chat_id = c.id) FROM chats c "
            "WHERE NOT c.is_open ORDER BY c.updated DESC LIMIT ?", (limit,)).fetchall()

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Messages of every chat, open or closed, that hold all the words of `query` (the last one may be the
        start of a word, for search as you type), best match first."""
        match = fts_query(query)
        if not match:
            return []
        rows = self.conn.execute(
            "SELECT m.chat_id, c.title, c.is_open, m.role, "
            "(SELECT count(*) FROM messages o WHERE o.chat_id = m.chat_id "
            " AND (o.idx < m.idx OR (o.idx = m.idx AND o.seq < m.seq))), "  # its place, as messages() orders
            "snippet(messages_fts, 0, ?, ?, '…', ?) "
            "FROM messages_fts JOIN messages m ON m.seq = messages_fts.rowid JOIN chats c ON c.id = m.chat_id "
            "WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
            (MATCH_OPEN, MATCH_CLOSE, SNIPPET_TOKENS, match, limit)).fetchall()
        return [SearchHit(chat_id=cid, title=title, message_index=index, role=role, snippet=snippet,
                          is_open=bool(is_open)) for cid, title, is_open, role, index, snippet in rows]

    def recent_prompts(self, limit: int = 500) -> list[str]:
        """The user's messages across all chats, newest chat first and latest message first, without repeats
        (prompt recall, tui/history.py)."""
        rows = self.conn.execute(
            "SELECT m.content FROM messages m JOIN chats c ON c.id = m.chat_id WHERE m.role = 'user' "
            "ORDER BY c.updated DESC, m.idx DESC, m.seq DESC LIMIT ?", (limit * 2,)).fetchall()
        return list(dict.fromkeys(content for (content,) in rows))[:limit]

    def drafts(self) -> dict[str, str]:
        """Each chat's unsent input, by chat id (chats without one are absent)."""
        return dict(self.conn.execute("SELECT chat_id, text FROM drafts").fetchall())

    def get_state(self, key: str, default: str | None = None) -> str | None:
        row = self.conn.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    # ---- writing: each call is one statement; run several in one Store.transaction() -----------------------
    def put_chat(self, chat: ChatRecord) -> None:
        """The chat's own row (title, system prompt, settings, tab place), not its messages."""
        self.conn.execute(
            "INSERT INTO chats (id, title, system_prompt, settings, position, is_open, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET title = excluded.title, "
            "system_prompt = excluded.system_prompt, settings = excluded.settings, "
            "position = excluded.position, is_open = excluded.is_open, updated = excluded.updated",
            (chat.id, chat.title, chat.system_prompt, json.dumps(chat.settings.to_dict()), chat.position,
             int(chat.is_open), chat.created, chat.updated))

    def ensure_chat(self, chat: ChatRecord) -> None:
        """The chat's row if it has none yet, leaving another instance's edits of an existing row alone."""
        self.conn.execute(
            "INSERT OR IGNORE INTO chats (id, title, system_prompt, settings, position, is_open, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (chat.id, chat.title, chat.system_prompt, json.dumps(chat.settings.to_dict()), chat.position,
             int(chat.is_open), chat.created, chat.updated))

    def put_message(self, chat_id: str, index: int, message: ChatMessage) -> None:
        self.conn.execute(
            "INSERT INTO messages (chat_id, id, idx, role, content, stats) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(chat_id, id) DO UPDATE SET idx = excluded.idx, role = excluded.role, "
            "content = excluded.content, stats = excluded.stats",
            (chat_id, message.id, index, message.role, message.content, encode_stats(message.stats)))

    def remove_messages(self, chat_id: str, message_ids: list[str]) -> None:
        self.conn.executemany("DELETE FROM messages WHERE chat_id = ? AND id = ?",
                              [(chat_id, mid) for mid in message_ids])

    def put_order(self, open_ids: list[str]) -> None:
        """Tab order of the open chats."""
        self.conn.executemany("UPDATE chats SET position = ?, is_open = 1 WHERE id = ?",
                              [(i, cid) for i, cid in enumerate(open_ids)])

    def put_draft(self, chat_id: str, text: str) -> None:
        """The chat's unsent input; an empty one leaves no row."""
        if text:
            self.conn.execute("INSERT INTO drafts (chat_id, text) VALUES (?, ?) "
                              "ON CONFLICT(chat_id) DO UPDATE SET text = excluded.text", (chat_id, text))
        else:
            self.conn.execute("DELETE FROM drafts WHERE chat_id = ?", (chat_id,))

    def put_state(self, key: str, value: str) -> None:
        self.conn.execute("INSERT INTO state (key, value) VALUES (?, ?) "
                          "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))

    # ---- one-call conveniences (each its own transaction) ----------------------------------------------------
    def save_chat(self, chat: ChatRecord) -> None:
        """Write the chat's row and upsert each of its messages (messages stored but not in `chat` stay)."""
        chat.updated = time.time()
        with self.transaction():
            self.put_chat(chat)
            for i, message in enumerate(chat.messages):
                self.put_message(chat.id, i, message)

    def save_order(self, open_ids: list[str]) -> None:
        with self.transaction():
            self.put_order(open_ids)

    def remove_chat(self, chat_id: str) -> None:
        """The chat and its messages (a cascade), and so their words in the search index (its triggers)."""
        self.conn.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def delete_chat(self, chat_id: str) -> None:
        with self.transaction():
            self.remove_chat(chat_id)
