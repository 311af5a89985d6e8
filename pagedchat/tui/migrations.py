"""The chats database's schema, as an ordered list of migrations (after Simon Willison's llm).

Each migration is a function that takes the database from one version to the next; `PRAGMA user_version`
counts how many have run. A migration never drops data: it copies it into the new shape in the same
transaction, so a failure leaves the file as it was. Append new migrations; never edit a released one.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

Migration = Callable[[sqlite3.Connection], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    MIGRATIONS.append(fn)
    return fn


class NewerSchema(Exception):
    """The file was written by a newer pagedchat: we cannot know what our writes would break."""

    def __init__(self, version: int) -> None:
        super().__init__(f"written by a newer pagedchat (schema {version}, this one knows {len(MIGRATIONS)})")
        self.version = version


@migration
def m001_initial(conn: sqlite3.Connection) -> None:
    conn.execute("""CREATE TABLE IF NOT EXISTS chats (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL,
        settings TEXT NOT NULL,
        position INTEGER NOT NULL,
        is_open INTEGER NOT NULL DEFAULT 1,
        created REAL NOT NULL,
        updated REAL NOT NULL)""")
    conn.execute("""CREATE TABLE IF NOT EXISTS messages (
        chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        stats TEXT,
        PRIMARY KEY (chat_id, idx))""")
    conn.execute("CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


@migration
def m002_message_ids(conn: sqlite3.Connection) -> None:
    """Messages keyed by a stable id, so a save upserts one message instead of rewriting the chat. idx only
    orders them; two instances adding to one chat may both write the same idx, and seq (insertion order)
    breaks the tie. seq is an INTEGER PRIMARY KEY, so VACUUM never renumbers it and an index may point at it."""
    conn.execute("""CREATE TABLE messages_v2 (
        seq INTEGER PRIMARY KEY,
        chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        id TEXT NOT NULL,
        idx INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        stats TEXT,
        UNIQUE (chat_id, id))""")
    conn.execute("INSERT INTO messages_v2 (chat_id, id, idx, role, content, stats) "
                 "SELECT chat_id, lower(hex(randomblob(8))), idx, role, content, stats FROM messages ORDER BY rowid")
    conn.execute("DROP TABLE messages")
    conn.execute("ALTER TABLE messages_v2 RENAME TO messages")
    conn.execute("CREATE INDEX messages_order ON messages (chat_id, idx)")


@migration
def m003_search(conn: sqlite3.Connection) -> None:
    """Full-text search over every message (FTS5, as llm does), kept in step with the table by triggers, so
    every save (and a streaming reply's, twice a second) updates it in the same transaction. External content:
    the text is stored once, in messages; the index maps seq to its words."""
    conn.execute("CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='seq')")
    conn.execute("""CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts (rowid, content) VALUES (new.seq, new.content); END""")
    conn.execute("""CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.seq, old.content); END""")
    conn.execute("""CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.seq, old.content);
        INSERT INTO messages_fts (rowid, content) VALUES (new.seq, new.content); END""")
    conn.execute("INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')")  # what was there before


@migration
def m004_drafts(conn: sqlite3.Connection) -> None:
    """Each chat's unsent input, so that a message refused as too long (or simply not sent yet) outlives a quit.
    A table of its own: a draft changes far more often than the chat's row, and is written alone."""
    conn.execute("""CREATE TABLE drafts (
        chat_id TEXT PRIMARY KEY REFERENCES chats(id) ON DELETE CASCADE,
        text TEXT NOT NULL)""")


SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def migrate(conn: sqlite3.Connection) -> None:
    """Bring the database up to SCHEMA_VERSION. conn is in autocommit mode (isolation_level None).

    BEGIN IMMEDIATE takes the write lock before the version is read again, so two instances starting at once
    never run the same migration twice. Raises NewerSchema, before writing anything, for a newer file."""
    if schema_version(conn) == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = schema_version(conn)
        if version > SCHEMA_VERSION:
            raise NewerSchema(version)
        for number, step in enumerate(MIGRATIONS[version:], start=version + 1):
            step(conn)
            conn.execute(f"PRAGMA user_version = {number}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
