"""The SQLite store: round trips, tab order, closed chats, a corrupt file moved aside."""

import sqlite3

from pagedchat.tui.records import ChatMessage, ChatRecord, ChatSettings, ReplyStats, title_from
from pagedchat.tui.store import DB_NAME, Store


def _chat(title="A chat", **kw):
    return ChatRecord(title=title, system_prompt="Be brief.", settings=ChatSettings(max_tokens=32, seed=7),
                      messages=[ChatMessage("user", "hi"),
                                ChatMessage("assistant", "hello", ReplyStats(5, 2, 3, 0.01, 99.0, "stop"))], **kw)


def test_round_trip(tmp_path):
    store = Store.open(tmp_path)
    chat = _chat()
    store.save_chat(chat)
    store.set_state("theme", "pagedchat-light")
    store.close()
    store = Store.open(tmp_path)
    assert store.notice is None
    [loaded] = store.load_chats()
    assert loaded.id == chat.id and loaded.title == "A chat" and loaded.system_prompt == "Be brief."
    assert loaded.settings == ChatSettings(max_tokens=32, seed=7)
    assert [(m.role, m.content) for m in loaded.messages] == [("user", "hi"), ("assistant", "hello")]
    assert loaded.messages[1].stats == ReplyStats(5, 2, 3, 0.01, 99.0, "stop")
    assert store.get_state("theme") == "pagedchat-light" and store.get_state("nothing", "x") == "x"


def test_order_and_closed_chats(tmp_path):
    store = Store.open(tmp_path)
    a, b, c = _chat("a"), _chat("b"), _chat("c")
    for r in (a, b, c):
        store.save_chat(r)
    store.save_order([c.id, a.id, b.id])
    store.set_open(a.id, False)
    assert [r.title for r in store.load_chats(open_only=True)] == ["c", "b"]
    assert [r.title for r in store.load_chats(open_only=False)] == ["a"]
    assert store.closed_chats() == [(a.id, "a", 2)]
    a.messages.pop()
    store.save_chat(a)  # rewriting replaces the messages
    assert len(next(r for r in store.load_chats() if r.id == a.id).messages) == 1
    store.delete_chat(b.id)
    assert {r.title for r in store.load_chats()} == {"a", "c"}


def test_corrupt_database_is_moved_aside(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not a database" * 100)
    store = Store.open(tmp_path)
    assert store.notice and "moved to" in store.notice
    assert store.load_chats() == []
    moved = list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))
    assert len(moved) == 1 and moved[0].read_bytes().startswith(b"this is not")
    store.save_chat(_chat())  # the fresh database works
    assert len(store.load_chats()) == 1


def test_bad_rows_count_as_corrupt(tmp_path):
    store = Store.open(tmp_path)
    store.save_chat(_chat())
    store.conn.execute("UPDATE chats SET settings = 'not json'")
    store.conn.commit()
    store.close()
    store = Store.open(tmp_path)
    assert store.notice and store.load_chats() == []


def test_newer_schema_is_not_overwritten(tmp_path):
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    store = Store.open(tmp_path)
    assert "newer" in store.notice


def test_markdown_export_and_titles():
    md = _chat().to_markdown()
    assert md.startswith("# A chat") and "## You" in md and "hello" in md and "prompt 5 · cached 2" in md
    assert title_from("  What is paged attention, and why does it matter so much?  ") == "What is paged attention…"
    assert title_from("") == "New chat"
    m = ChatMessage("assistant", "text\n```python\nprint(1)\n```\nmore\n~~~\nx\n~~~\n")
    assert m.code_blocks() == ["print(1)", "x"]
