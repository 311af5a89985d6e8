"""Finding things across every saved chat, open or closed: full-text search and earlier prompts.

The index is an SQLite FTS5 table over `messages.content` (after Simon Willison's llm). It is an external-content
table kept in step by triggers, so every way a message row is written, updated or deleted (a save, a cascade
from deleting its chat) updates the index in the same transaction, and nothing in the store has to remember it.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass

HIT_OPEN, HIT_CLOSE = "\x02", "\x03"   # snippet markers: control characters no message text contains
SNIPPET_TOKENS = 12


def install_index(conn: sqlite3.Connection) -> None:
    """Create the index and its triggers, and fill it from the messages already there (a migration step)."""
    conn.execute("CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', "
                 "content_rowid='rowid', tokenize='unicode61 remove_diacritics 2')")
    conn.execute("CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
                 "INSERT INTO messages_fts (rowid, content) VALUES (new.rowid, new.content); END")
    conn.execute("CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
                 "INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content); "
                 "END")
    conn.execute("CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN "
                 "INSERT INTO messages_fts (messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content); "
                 "INSERT INTO messages_fts (rowid, content) VALUES (new.rowid, new.content); END")
    conn.execute("INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')")


@dataclass(frozen=True)
class SearchHit:
    chat_id: str
    title: str
    index: int          # the message's place in its chat
    role: str
    snippet: str        # matched words between HIT_OPEN and HIT_CLOSE
    is_open: bool


def fts_query(text: str) -> str | None:
    """Words as an FTS5 query: every word must appear, the last one as a prefix (it may be half typed).
    Each word is quoted, so what the user types is never read as FTS5 syntax."""
    words = re.findall(r"\w+", text)
    if not words:
        return None
    quoted = [f'"{w}"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


def search_messages(conn: sqlite3.Connection, text: str, limit: int = 30) -> list[SearchHit]:
    """Messages of every chat that contain all the words of `text`, best match first."""
    query = fts_query(text)
    if query is None:
        return []
    rows = conn.execute(
        "SELECT m.chat_id, c.title, (SELECT count(*) FROM messages e WHERE e.chat_id = m.chat_id "
        "AND e.idx < m.idx), m.role, snippet(messages_fts, 0, ?, ?, '…', ?), c.is_open "
        "FROM messages_fts JOIN messages m ON m.rowid = messages_fts.rowid JOIN chats c ON c.id = m.chat_id "
        "WHERE messages_fts MATCH ? ORDER BY bm25(messages_fts) LIMIT ?",
        (HIT_OPEN, HIT_CLOSE, SNIPPET_TOKENS, query, limit)).fetchall()
    return [SearchHit(cid, title, index, role, " ".join(snippet.split()), bool(is_open))
            for cid, title, index, role, snippet, is_open in rows]


def recent_prompts(conn: sqlite3.Connection, limit: int = 500) -> list[str]:
    """The user's messages across all chats, newest chat first and latest message first, without repeats."""
    rows = conn.execute("SELECT m.content FROM messages m JOIN chats c ON c.id = m.chat_id WHERE m.role = 'user' "
                        "ORDER BY c.updated DESC, m.idx DESC LIMIT ?", (limit * 2,)).fetchall()
    return list(dict.fromkeys(content for (content,) in rows))[:limit]
