"""Saved chats in SQLite (`chats.db` in the data dir).

Small and synchronous on purpose: a chat is written when it changes (a message sent or finished, settings
edited, a tab moved), never per token, so each write is a few milliseconds on the UI thread. A database that
cannot be read is renamed aside with a timestamp and a fresh one is started; the caller tells the user.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from pagedchat.tui.records import ChatMessage, ChatRecord, ChatSettings, ReplyStats
from pagedchat.tui.search import SearchHit, install_index, recent_prompts, search_messages

DB_NAME = "chats.db"
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL,
    settings TEXT NOT NULL,
    position INTEGER NOT NULL,
    is_open INTEGER NOT NULL DEFAULT 1,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT,
    PRIMARY KEY (chat_id, idx)
);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class Store:
    """The chats database. Use Store.open(); `notice` says what happened if the old file was moved aside."""

    def __init__(self, conn: sqlite3.Connection, path: Path, notice: str | None = None):
        self.conn = conn
        self.path = path
        self.notice = notice

    # ---- opening -----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, data_dir: Path) -> Store:
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / DB_NAME
        conn = None
        try:
            conn = cls._connect(path)
            store = cls(conn, path)
            store.load_chats()  # reads every row: a damaged page or bad JSON shows up now, not mid-session
            return store
        except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as exc:
            if conn is not None:
                conn.close()
            moved = cls._move_aside(path)
            store = cls(cls._connect(path), path)
            store.notice = (f"Saved chats could not be read ({exc}); the database was moved to {moved.name} "
                            f"in {data_dir} and pagedchat started with no saved chats.")
            return store

    @classmethod
    def in_memory(cls, notice: str | None = None) -> Store:
        """A throwaway store, for when the data dir cannot be written: the app still runs, nothing is kept."""
        return cls(cls._connect(Path(":memory:")), Path(":memory:"), notice)

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check[0] if check else 'no answer'}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"written by a newer pagedchat (schema {version})")
            with conn:
                conn.executescript(SCHEMA)
                if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone():
                    install_index(conn)  # a database from before search: index what it holds
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            conn.close()  # or the file stays open and cannot be moved aside on Windows
            raise
        return conn

    @staticmethod
    def _move_aside(path: Path) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = path.with_name(f"{path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        path.rename(target)
        for suffix in ("-journal", "-wal", "-shm"):  # SQLite's side files belong to the moved database
            side = path.with_name(path.name + suffix)
            if side.exists():
                side.rename(target.with_name(target.name + suffix))
        return target

    def close(self) -> None:
        self.conn.close()

    # ---- chats -------------------------------------------------------------------------------------------
    def load_chats(self, *, open_only: bool | None = None) -> list[ChatRecord]:
        """Chats in tab order (closed ones last, newest first). open_only: True open, False closed, None all."""
        rows = self.conn.execute(
            "SELECT id, title, system_prompt, settings, position, is_open, created, updated FROM chats "
            "ORDER BY is_open DESC, CASE WHEN is_open THEN position ELSE -updated END").fetchall()
        chats = []
        for cid, title, system, settings, position, is_open, created, updated in rows:
            if open_only is not None and bool(is_open) != open_only:
                continue
            chats.append(ChatRecord(id=cid, title=title, system_prompt=system,
                                    settings=ChatSettings.from_dict(json.loads(settings)),
                                    messages=self._messages(cid), position=position, is_open=bool(is_open),
                                    created=created, updated=updated))
        return chats

    def _messages(self, chat_id: str) -> list[ChatMessage]:
        rows = self.conn.execute("SELECT role, content, stats FROM messages WHERE chat_id = ? ORDER BY idx",
                                 (chat_id,)).fetchall()
        out = []
        for role, content, stats in rows:
            if role not in ("user", "assistant"):
                raise ValueError(f"unknown message role {role!r}")
            out.append(ChatMessage(role, content, ReplyStats.from_dict(json.loads(stats) if stats else None)))
        return out

    def closed_chats(self, limit: int = 20) -> list[tuple[str, str, int]]:
        """(id, title, message count) of closed chats, newest first; cheap enough for every palette opening."""
        return self.conn.execute(
            "SELECT c.id, c.title, (SELECT count(*) FROM messages m WHERE m.chat_id = c.id) FROM chats c "
            "WHERE NOT c.is_open ORDER BY c.updated DESC LIMIT ?", (limit,)).fetchall()

    def save_chat(self, chat: ChatRecord) -> None:
        """Write the chat and all its messages (replacing what was stored)."""
        chat.updated = time.time()
        with self.conn:
            self.conn.execute(
                "INSERT INTO chats (id, title, system_prompt, settings, position, is_open, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET title = excluded.title, "
                "system_prompt = excluded.system_prompt, settings = excluded.settings, "
                "position = excluded.position, is_open = excluded.is_open, updated = excluded.updated",
                (chat.id, chat.title, chat.system_prompt, json.dumps(chat.settings.to_dict()), chat.position,
                 int(chat.is_open), chat.created, chat.updated))
            self.conn.execute("DELETE FROM messages WHERE chat_id = ?", (chat.id,))
            self.conn.executemany(
                "INSERT INTO messages (chat_id, idx, role, content, stats) VALUES (?, ?, ?, ?, ?)",
                [(chat.id, i, m.role, m.content, json.dumps(m.stats.__dict__) if m.stats else None)
                 for i, m in enumerate(chat.messages)])

    def save_order(self, open_ids: list[str]) -> None:
        """Tab order of the open chats."""
        with self.conn:
            self.conn.executemany("UPDATE chats SET position = ?, is_open = 1 WHERE id = ?",
                                  [(i, cid) for i, cid in enumerate(open_ids)])

    def set_open(self, chat_id: str, is_open: bool) -> None:
        with self.conn:
            self.conn.execute("UPDATE chats SET is_open = ?, updated = ? WHERE id = ?",
                              (int(is_open), time.time(), chat_id))

    def delete_chat(self, chat_id: str) -> None:
        with self.conn:
            self.conn.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # ---- small app state (theme, active tab) ---------------------------------------------------------------
    def get_state(self, key: str, default: str | None = None) -> str | None:
        row = self.conn.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_state(self, key: str, value: str) -> None:
        with self.conn:
            self.conn.execute("INSERT INTO state (key, value) VALUES (?, ?) "
                              "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))

    # ---- across all chats (tui/search.py) --------------------------------------------------------------------
    def search(self, text: str, limit: int = 30) -> list[SearchHit]:
        return search_messages(self.conn, text, limit)

    def recent_prompts(self, limit: int = 500) -> list[str]:
        return recent_prompts(self.conn, limit)
