"""Search across chats (tui/search.py): the FTS5 index migrated into an old database and kept in step with
saves, edits and deletes; what users type is never FTS5 syntax; earlier prompts newest first."""

from pagedchat.tui.records import ChatMessage, ChatRecord
from pagedchat.tui.search import fts_query
from pagedchat.tui.store import DB_NAME, Store
from test_store import _v1_file


def _integrity(store: Store) -> None:
    # FTS5's own check: the index holds exactly what the messages table holds (raises if not).
    store.conn.execute("INSERT INTO messages_fts (messages_fts, rank) VALUES ('integrity-check', 1)")


def test_index_survives_the_migration_of_an_old_database(tmp_path):
    _v1_file(tmp_path / DB_NAME, [("c1", [("user", "how do aardvarks sleep"), ("assistant", "curled up")]),
                                  ("c2", [("user", "pick a colour"), ("assistant", "aardvark grey")])])
    store = Store.open(tmp_path)
    assert store.notice is None
    _integrity(store)
    hits = store.search("aardvark")
    assert {(h.chat_id, h.index, h.role) for h in hits} == {("c1", 0, "user"), ("c2", 1, "assistant")}
    assert hits[0].title in ("chat c1", "chat c2") and "\x02aardvark" in hits[0].snippet
    store.close()

    store = Store.open(tmp_path)   # opened again: no second migration, the same index
    assert len(store.search("aardvark")) == 2
    [c1] = [c for c in store.load_chats() if c.id == "c1"]
    c1.messages[1].content = "in burrows, by day"   # an edit is an upsert of one message
    c1.messages.append(ChatMessage("user", "and badgers?"))
    store.save_chat(c1)
    assert [h.index for h in store.search("burrows")] == [1] and store.search("curled") == []
    assert [(h.chat_id, h.index) for h in store.search("badg")] == [("c1", 2)]   # the last word as a prefix
    store.delete_chat("c2")
    assert [h.chat_id for h in store.search("aardvark")] == ["c1"]
    _integrity(store)
    store.close()


def test_what_users_type_is_never_fts_syntax(tmp_path):
    store = Store.open(tmp_path)
    store.save_chat(ChatRecord(title="Quotes", messages=[ChatMessage("user", 'she said "NEAR" AND left')]))
    for text in ('"', 'said "near', "AND OR NOT", "(*)", "near(", "-left", "col:said"):
        store.search(text)   # no sqlite3.OperationalError
    assert [h.title for h in store.search('said "NEAR')] == ["Quotes"]
    assert fts_query("  ") is None and store.search("  ") == []
    assert fts_query("a b") == '"a" "b"*'


def test_closed_chats_are_searched_and_marked(tmp_path):
    store = Store.open(tmp_path)
    record = ChatRecord(title="Old", is_open=False, messages=[ChatMessage("user", "zebra crossings")])
    store.save_chat(record)
    [hit] = store.search("zebra")
    assert hit.chat_id == record.id and not hit.is_open


def test_recent_prompts_newest_chat_first_without_repeats(tmp_path):
    store = Store.open(tmp_path)
    old = ChatRecord(title="old", updated=1.0, messages=[ChatMessage("user", "one"), ChatMessage("assistant", "x"),
                                                          ChatMessage("user", "two")])
    new = ChatRecord(title="new", messages=[ChatMessage("user", "three"), ChatMessage("user", "one")])
    store.save_chat(old)
    store.save_chat(new)   # saved later: newer
    assert store.recent_prompts() == ["one", "three", "two"]

