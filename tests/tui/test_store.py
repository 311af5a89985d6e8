"""The SQLite store: round trips, per-message saves shared by two instances, locks, a full disk, migrations,
a newer file refused untouched, and damaged files salvaged row by row."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pagedchat.engine.records import FinishReason, Outcome
from pagedchat.tui.migrations import SCHEMA_VERSION
from pagedchat.tui.conversation import (MATCH_CLOSE, MATCH_OPEN, ChatMessage, ChatRecord, ChatSettings,
                                    stats_line, title_from)
from pagedchat.tui.saver import Saver
from pagedchat.tui.store import DB_NAME, Store

# The schema pagedchat 0.1 wrote (user_version 1): messages keyed by position, whole chats rewritten.
V1_SCHEMA = """
CREATE TABLE chats (id TEXT PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT NOT NULL, settings TEXT NOT NULL,
    position INTEGER NOT NULL, is_open INTEGER NOT NULL DEFAULT 1, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT, PRIMARY KEY (chat_id, idx));
CREATE TABLE state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
PRAGMA user_version = 1;
"""


SIDE_FILES = ("-wal", "-shm", "-journal")
STATS = Outcome(prompt_tokens=5, cached_tokens=2, generated_tokens=3, time_to_first_token=0.01,
                decode_tokens_per_s=99.0, finish_reason=FinishReason.STOP)


def _chat(title="A chat", **kw):
    return ChatRecord(title=title, system_prompt="Be brief.", settings=ChatSettings(max_tokens=32, seed=7),
                      messages=[ChatMessage("user", "hi"),
                                ChatMessage("assistant", "hello", STATS)], **kw)


class Reports(list):
    def __call__(self, text, severity):
        self.append((severity, text))


def _v1_file(path, chats):
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    for n, (cid, messages) in enumerate(chats):
        conn.execute("INSERT INTO chats VALUES (?, ?, '', '{}', ?, 1, 1.0, 1.0)", (cid, f"chat {cid}", n))
        conn.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, NULL)",
                         [(cid, i, role, text) for i, (role, text) in enumerate(messages)])
    conn.commit()
    conn.close()


def _aside(tmp_path):
    """The damaged files renamed aside (without SQLite's -wal/-shm side files)."""
    return sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name and not p.name.endswith(SIDE_FILES))


def test_round_trip(tmp_path):
    store = Store.open(tmp_path)
    chat = _chat()
    store.save_chat(chat)
    with store.transaction():   # as the saver writes state
        store.put_state("theme", "pagedchat-light")
    store.close()
    store = Store.open(tmp_path)
    assert store.notice is None
    [loaded] = store.load_chats()
    assert loaded.id == chat.id and loaded.title == "A chat" and loaded.system_prompt == "Be brief."
    assert loaded.settings == ChatSettings(max_tokens=32, seed=7)
    assert [(m.role, m.content, m.id) for m in loaded.messages] == [(m.role, m.content, m.id) for m in chat.messages]
    assert loaded.messages[1].stats == STATS
    assert store.get_state("theme") == "pagedchat-light" and store.get_state("nothing", "x") == "x"


def test_a_read_only_store_reads_a_live_file_and_never_writes_it(tmp_path):
    writer = Store.open(tmp_path)
    chat = _chat()
    writer.save_chat(chat)
    path = tmp_path / DB_NAME
    before = path.read_bytes()
    reader = Store.read_only(path)
    try:
        [seen] = reader.load_chats()
        assert [m.content for m in seen.messages] == [m.content for m in chat.messages]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.save_chat(_chat())
    finally:
        reader.close()
    assert path.read_bytes() == before and not list(tmp_path.glob(DB_NAME + "-*"))
    writer.close()


def test_a_read_only_store_before_the_tables_exist_raises_operational_error(tmp_path):
    sqlite3.connect(tmp_path / DB_NAME).close()  # an empty file, as just after the app created it
    reader = Store.read_only(tmp_path / DB_NAME)
    try:
        with pytest.raises(sqlite3.OperationalError):
            reader.load_chats()
    finally:
        reader.close()


def test_rollback_journal_no_mmap_and_busy_timeout(tmp_path):
    # A file an older pagedchat left in WAL mode comes back to a rollback journal: no memory-mapped -shm.
    old = sqlite3.connect(tmp_path / DB_NAME)
    old.execute("PRAGMA journal_mode = WAL")
    old.close()
    store = Store.open(tmp_path, busy_timeout_s=1.5)
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert store.conn.execute("PRAGMA mmap_size").fetchone()[0] == 0
    store.save_chat(_chat("a"))
    assert not (tmp_path / (DB_NAME + "-shm")).exists()
    assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 1500
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_chats_saved_before_the_penalties_load_with_their_defaults(tmp_path):
    """A settings row written before presence/frequency/repetition penalties and min_tokens existed."""
    store = Store.open(tmp_path)
    store.save_chat(_chat())
    store.close()
    old = '{"max_tokens": 32, "temperature": 0.3, "top_p": 0.9, "top_k": 5, "seed": 7}'
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute("UPDATE chats SET settings = ?", (old,))
    store = Store.open(tmp_path)
    [loaded] = store.load_chats()
    assert loaded.settings == ChatSettings(max_tokens=32, temperature=0.3, top_p=0.9, top_k=5, seed=7)
    assert (loaded.settings.presence_penalty, loaded.settings.frequency_penalty, loaded.settings.repetition_penalty,
            loaded.settings.min_tokens) == (0.0, 0.0, 1.0, 0)
    # and the new fields are saved and read back
    penalised = ChatSettings(max_tokens=32, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                             min_tokens=4)
    store.save_chat(replace(loaded, settings=penalised))
    store.close()
    assert Store.open(tmp_path).load_chats()[0].settings == penalised


def test_order_and_closed_chats(tmp_path):
    store = Store.open(tmp_path)
    a, b, c = _chat("a"), _chat("b"), _chat("c")
    for r in (a, b, c):
        store.save_chat(r)
    store.save_order([c.id, a.id, b.id])
    a.is_open = False   # as the app closes a tab: the record saved closed
    store.save_chat(a)
    assert [r.title for r in store.load_chats(open_only=True)] == ["c", "b"]
    assert [r.title for r in store.load_chats(open_only=False)] == ["a"]
    assert store.closed_chats() == [(a.id, "a", 2)]
    with store.transaction():
        store.remove_messages(a.id, [a.messages.pop().id])
    assert len(store.load_chat(a.id).messages) == 1
    store.delete_chat(b.id)
    assert {r.title for r in store.load_chats()} == {"a", "c"}


def test_two_instances_on_one_chat_keep_each_others_messages(tmp_path):
    """Both instances loaded the same chat; each adds a turn and one regenerates its own reply. Before
    per-message saves, the last writer's whole-chat rewrite deleted the other's turn."""
    first = Store.open(tmp_path)
    first.save_chat(_chat("shared"))
    second = Store.open(tmp_path)
    saves = [Saver(first, Reports()), Saver(second, Reports())]
    copies = [first.load_chats()[0], second.load_chats()[0]]
    for n, (saver, record) in enumerate(zip(saves, copies)):
        record.messages += [ChatMessage("user", f"question {n}"), ChatMessage("assistant", f"answer {n}")]
        saver.message(record, 2)
        saver.message(record, 3)
    saves[1].flush()
    saves[0].flush()
    regenerated = copies[1].messages.pop()
    saves[1].removed(copies[1], [regenerated])
    copies[1].messages.append(ChatMessage("assistant", "answer 1, again"))
    saves[1].message(copies[1], 3)
    assert saves[1].flush()
    texts = [m.content for m in Store.open(tmp_path).load_chats()[0].messages]
    assert texts[:2] == ["hi", "hello"]
    assert sorted(texts[2:]) == ["answer 0", "answer 1, again", "question 0", "question 1"]


def test_a_saver_writes_only_what_it_marked(tmp_path):
    """An instance with a stale copy of a chat must not write it back over another instance's changes."""
    store = Store.open(tmp_path)
    chat = _chat("mine")
    saver = Saver(store, Reports())
    saver.chat(chat, messages=True)
    saver.flush()
    other = Store.open(tmp_path)
    theirs = other.load_chat(chat.id)
    theirs.messages[1].content = "hello, edited elsewhere"
    other.save_chat(theirs)
    chat.messages.append(ChatMessage("user", "more"))
    saver.message(chat, 2)  # the stale copy of message 1 is not marked, so it is not written
    saver.flush()
    assert [m.content for m in other.load_chat(chat.id).messages] == ["hi", "hello, edited elsewhere", "more"]


def test_drafts_are_saved_when_they_change_and_go_with_their_chat(tmp_path):
    store = Store.open(tmp_path)
    chat, other = _chat("drafted"), _chat("other")
    saver = Saver(store, Reports())
    saver.draft(chat, "half a thought")   # a chat never saved before gets its row with its draft
    saver.draft(other, "kept", saved=True)   # as read from the store: nothing to write
    saver.flush()
    assert Store.open(tmp_path).drafts() == {chat.id: "half a thought"}
    saver.draft(chat, "half a thought")
    assert not saver.pending   # unchanged: not written again
    saver.draft(chat, "")      # sent: the draft goes
    saver.flush()
    assert store.drafts() == {}
    saver.draft(chat, "again")
    saver.flush()
    store.delete_chat(chat.id)
    assert store.drafts() == {}


def test_held_lock_on_an_old_file_is_not_damage(tmp_path):
    """Another program holds an exclusive lock on a rollback-journal file: pagedchat says so and leaves it."""
    path = tmp_path / DB_NAME
    _v1_file(path, [("c1", [("user", "keep me")])])
    before = path.read_bytes()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    store = Store.open(tmp_path, busy_timeout_s=0.1)
    assert "locked" in store.notice and "left as it is" in store.notice, store.notice
    assert store.load_chats() == [] and _aside(tmp_path) == []
    holder.execute("ROLLBACK")
    holder.close()
    assert path.read_bytes() == before
    store = Store.open(tmp_path, busy_timeout_s=0.1)  # once free, it opens (and migrates) with its chats
    assert store.notice is None and [m.content for m in store.load_chats()[0].messages] == ["keep me"]


def test_write_held_past_the_timeout_is_retried(tmp_path):
    """Another connection holds BEGIN EXCLUSIVE: the save fails with a report, keeps its marks, and the retry
    after the lock is released writes them."""
    store = Store.open(tmp_path, busy_timeout_s=0.1)
    holder = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    reports = Reports()
    saver = Saver(store, reports)
    chat = _chat("during the lock")
    saver.chat(chat, messages=True)
    assert not saver.flush() and not saver.retry()
    assert len(reports) == 1 and reports[0][0] == "error" and "locked" in reports[0][1], reports
    chat.messages.append(ChatMessage("user", "still typing"))
    saver.message(chat, 2)
    started = time.monotonic()
    assert not saver.flush() and time.monotonic() - started < 0.05  # while failing, only retries wait
    holder.execute("COMMIT")
    assert saver.retry() and not saver.pending
    assert reports[-1] == ("information", "Chats are being saved again.")
    assert [m.content for m in Store.open(tmp_path).load_chat(chat.id).messages] == ["hi", "hello", "still typing"]
    assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 100  # a retry's shorter wait is undone


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from pagedchat.tui.conversation import ChatMessage, ChatRecord
from pagedchat.tui.saver import Saver
from pagedchat.tui.store import Store

folder = Path(sys.argv[1])
store = Store.open(folder)
reports = []
saver = Saver(store, lambda text, severity: reports.append(text))
chat = ChatRecord(title="big")
saver.chat(chat, messages=True)
assert saver.flush()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
used = max(p.stat().st_size for p in folder.iterdir())
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (used + 8192, hard))
chat.messages.append(ChatMessage("assistant", "x" * 200_000))
saver.message(chat, 0)
assert not saver.flush(), "the write should not fit"
assert saver.pending and len(reports) == 1, reports
print(reports[0])
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again: the retry writes it
assert saver.retry(), "the retry should succeed"
print("retried")
"""


def test_full_disk_is_reported_and_retried(tmp_path):
    """RLIMIT_FSIZE makes the next write fail as a full disk does; nothing raises, the retry saves it."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(FULL_DISK), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "Could not save chats" in run.stdout and "retried" in run.stdout, run.stdout
    [chat] = Store.open(tmp_path).load_chats()
    assert chat.messages[0].content == "x" * 200_000


def test_newer_schema_is_refused_and_untouched(tmp_path):
    path = tmp_path / DB_NAME
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE future (x); INSERT INTO future VALUES (1); PRAGMA user_version = 99;")
    conn.close()
    before = path.read_bytes()
    store = Store.open(tmp_path)
    assert "newer pagedchat (schema 99" in store.notice and "untouched" in store.notice, store.notice
    assert store.load_chats() == []
    store.save_chat(_chat())  # the session still works, in memory
    assert path.read_bytes() == before and _aside(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_NAME]


def test_migration_from_version_1_keeps_every_message(tmp_path):
    _v1_file(tmp_path / DB_NAME, [("c1", [("user", "one"), ("assistant", "two"), ("user", "three")]),
                                  ("c2", [("user", "other")])])
    store = Store.open(tmp_path)
    assert store.notice is None
    chats = {c.id: c for c in store.load_chats()}
    assert [m.content for m in chats["c1"].messages] == ["one", "two", "three"]
    assert [m.content for m in chats["c2"].messages] == ["other"]
    ids = [m.id for m in chats["c1"].messages]
    assert len(set(ids)) == 3 and all(ids)
    store.close()
    again = Store.open(tmp_path).load_chats()  # ids are stored, not made up at each load
    assert [m.id for m in next(c for c in again if c.id == "c1").messages] == ids


def test_not_a_database_is_kept_and_a_fresh_one_started(tmp_path):
    original = b"this is not a database" * 100
    (tmp_path / DB_NAME).write_bytes(original)
    store = Store.open(tmp_path)
    assert "Recovered 0 chats" in store.notice and "kept untouched" in store.notice, store.notice
    [moved] = _aside(tmp_path)
    assert moved in store.notice and (tmp_path / moved).read_bytes() == original
    store.save_chat(_chat())  # the fresh database works
    assert len(store.load_chats()) == 1


def test_bad_rows_hide_nothing_else(tmp_path):
    """A chat whose settings do not decode keeps its messages; a message row that does not decode is the only
    thing lost."""
    store = Store.open(tmp_path)
    good, odd = _chat("good"), _chat("odd settings")
    store.save_chat(good)
    store.save_chat(odd)
    store.conn.execute("UPDATE chats SET settings = 'not json' WHERE id = ?", (odd.id,))
    store.conn.execute("UPDATE messages SET role = 'wizard' WHERE id = ?", (good.messages[0].id,))
    store.close()
    store = Store.open(tmp_path)
    assert "Recovered 2 chats (3 messages)" in store.notice and "1 damaged rows" in store.notice, store.notice
    chats = {c.title: c for c in store.load_chats()}
    assert [m.content for m in chats["good"].messages] == ["hello"]
    assert [m.content for m in chats["odd settings"].messages] == ["hi", "hello"]
    assert chats["odd settings"].settings == ChatSettings()
    [moved] = _aside(tmp_path)
    kept = sqlite3.connect(tmp_path / moved)
    assert kept.execute("SELECT settings FROM chats WHERE id = ?", (odd.id,)).fetchone() == ("not json",)


def test_a_damaged_page_loses_only_its_rows(tmp_path):
    store = Store.open(tmp_path)
    chats = []
    for n in range(6):
        chat = ChatRecord(title=f"chat {n}", messages=[ChatMessage("user", f"MARK-{n}-{k}|" + "y" * 3000)
                                                       for k in range(2)])
        store.save_chat(chat)
        chats.append(chat)
    store.close()  # the last connection checkpoints the WAL into the file
    path = tmp_path / DB_NAME
    data = bytearray(path.read_bytes())
    page_size = 4096
    start = data.index(b"MARK-3-0|") // page_size * page_size
    lost = {bytes(m) for m in __import__("re").findall(rb"MARK-\d-\d\|", bytes(data[start:start + page_size]))}
    data[start:start + page_size] = bytes(page_size)
    path.write_bytes(bytes(data))
    damaged = bytes(data)

    store = Store.open(tmp_path)
    assert "Saved chats were damaged" in store.notice and "Recovered 6 chats (11 messages)" in store.notice, \
        store.notice
    found = {m.content.split("|")[0] + "|" for c in store.load_chats() for m in c.messages}
    every = {f"MARK-{n}-{k}|" for n in range(6) for k in range(2)}
    assert found == every - {m.decode() for m in lost} and len(lost) == 1
    [moved] = _aside(tmp_path)
    assert (tmp_path / moved).read_bytes() == damaged


def _many_chats(store, chats=12, messages=40):
    """480 messages; every fifth long enough to run onto overflow pages."""
    made = []
    for n in range(chats):
        chat = ChatRecord(title=f"chat {n}", messages=[
            ChatMessage("user" if k % 2 == 0 else "assistant", f"M-{n}-{k}|" + ("word " * (2000 if k % 5 == 0 else 60)))
            for k in range(messages)])
        store.save_chat(chat)
        made.append(chat)
    return made


def test_a_file_cut_in_half_gives_back_the_rows_on_its_pages(tmp_path):
    """SQLite reaches no row past the missing interior pages (the row-by-row read alone recovered 0 of 480);
    every leaf page still in the file gives its rows back, exactly as written and in order."""
    store = Store.open(tmp_path)
    made = {c.id: c for c in _many_chats(store)}
    store.close()
    path = tmp_path / DB_NAME
    os.truncate(path, path.stat().st_size // 2)
    cut = path.read_bytes()
    store = Store.open(tmp_path)
    recovered = store.load_chats()
    found = sum(len(c.messages) for c in recovered)
    assert found >= 160 and f"({found} messages)" in store.notice, store.notice
    for chat in recovered:
        original = made[chat.id]
        assert chat.title == original.title
        by_id = {m.id: m for m in original.messages}
        assert all(by_id[m.id].content == m.content and by_id[m.id].role == m.role for m in chat.messages)
        order = [original.messages.index(by_id[m.id]) for m in chat.messages]
        assert order == sorted(order)
    [moved] = _aside(tmp_path)
    assert (tmp_path / moved).read_bytes() == cut


def test_deleted_chats_stay_deleted_through_a_salvage(tmp_path):
    store = Store.open(tmp_path)
    doomed, kept = _many_chats(store, chats=2)
    store.delete_chat(doomed.id)   # its pages go on the free list, their old rows still in them
    store.close()
    path = tmp_path / DB_NAME
    os.truncate(path, path.stat().st_size * 3 // 4)
    store = Store.open(tmp_path)
    assert store.notice is not None
    recovered = store.load_chats()
    assert recovered and all(c.id == kept.id for c in recovered)
    assert all(not m.content.startswith("M-0-") for c in recovered for m in c.messages)


def test_an_empty_file_is_kept_aside_with_a_notice(tmp_path):
    path = tmp_path / DB_NAME
    path.write_bytes(b"")
    os.utime(path, (time.time() - 60, time.time() - 60))   # not one another instance is creating right now
    store = Store.open(tmp_path)
    assert "the file is empty, 0 bytes" in store.notice and "Recovered 0 chats" in store.notice, store.notice
    [moved] = _aside(tmp_path)
    assert (tmp_path / moved).read_bytes() == b""
    store.save_chat(_chat())
    assert len(Store.open(tmp_path).load_chats()) == 1


def test_a_file_another_instance_just_created_is_not_moved(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"")
    store = Store.open(tmp_path)
    assert store.notice is None and not _aside(tmp_path)


def test_a_database_linked_to_a_device_is_refused(tmp_path):
    journal_existed = os.path.exists("/dev/null-journal")
    (tmp_path / DB_NAME).symlink_to("/dev/null")
    store = Store.open(tmp_path)
    assert store.path == Path(":memory:")
    assert "is a device (/dev/null), not a file" in store.notice, store.notice
    store.save_chat(_chat())   # the session still works, in memory
    assert os.path.exists("/dev/null-journal") == journal_existed
    assert (tmp_path / DB_NAME).is_symlink()


SAVED_BEFORE_THE_ENUM = [("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
                         ("context_full", FinishReason.CONTEXT_FULL), ("cancelled", FinishReason.CANCELLED),
                         ("error", FinishReason.ERROR), ("interrupted", FinishReason.INTERRUPTED),
                         ("tool_calls", FinishReason.TOOL_CALLS),
                         ("content_filter", FinishReason.STOP)]   # a server's own word, once saved as it came


@pytest.mark.parametrize("word, reason", SAVED_BEFORE_THE_ENUM)
def test_finish_reasons_saved_as_words_load_as_the_enum_and_save_as_the_same_words(tmp_path, word, reason):
    """chats.db keeps the finish reason as a word inside the stats JSON: an older file's words load unchanged."""
    store = Store.open(tmp_path)
    chat = _chat()
    store.save_chat(chat)
    store.close()
    old = {"prompt_tokens": 5, "cached_tokens": 2, "generated_tokens": 3, "ttft": 0.01, "tokens_per_s": 99.0,
           "finish_reason": word, "error": "boom" if word == "error" else None}   # an older version's row
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("UPDATE messages SET stats = ? WHERE role = 'assistant'", (json.dumps(old),))
    conn.commit()
    conn.close()
    store = Store.open(tmp_path)
    [loaded] = store.load_chats()
    stats = loaded.messages[1].stats
    assert stats.finish_reason is reason
    assert stats_line(stats) == stats_line(replace(STATS, finish_reason=reason, error=old["error"]))
    store.save_chat(loaded)
    store.close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    [(saved,)] = conn.execute("SELECT stats FROM messages WHERE role = 'assistant'").fetchall()
    conn.close()
    assert json.loads(saved)["finish_reason"] == reason.value
    assert set(json.loads(saved)) == set(old) | {"counted"}   # the names older versions read


def test_interrupted_replies_say_so():
    stats = Outcome(prompt_tokens=12, generated_tokens=40, time_to_first_token=0.05, decode_tokens_per_s=20.0,
                    finish_reason=FinishReason.INTERRUPTED)
    assert stats_line(stats).endswith("· interrupted")


def test_markdown_export_and_titles():
    md = _chat().to_markdown()
    assert md.startswith("# A chat") and "## You" in md and "hello" in md and "prompt 5 · cached 2" in md
    assert title_from("  What is paged attention, and why does it matter so much?  ") == "What is paged attention…"
    assert title_from("") == "New chat"
    m = ChatMessage("assistant", "text\n```python\nprint(1)\n```\nmore\n~~~\nx\n~~~\n")
    assert m.code_blocks() == ["print(1)", "x"]


def test_search_survives_the_migration_of_an_old_database(tmp_path):
    """A version-1 file gets its index at migration, and the index then follows every save and delete."""
    _v1_file(tmp_path / DB_NAME, [("c1", [("user", "how do lighthouses work"), ("assistant", "a lamp and a lens")]),
                                  ("c2", [("user", "paged attention, please"), ("assistant", "pages of the cache")])])
    store = Store.open(tmp_path)
    assert store.notice is None
    [hit] = store.search("lens")
    assert (hit.chat_id, hit.title, hit.message_index, hit.role) == ("c1", "chat c1", 1, "assistant")
    assert hit.snippet == f"a lamp and a {MATCH_OPEN}lens{MATCH_CLOSE}"
    assert [h.chat_id for h in store.search("page")] == ["c2", "c2"]  # the last word matches as a prefix
    assert store.search('"') == [] and store.search("   ") == []   # typed punctuation is only text

    saver = Saver(store, Reports())
    chat = store.load_chat("c1")
    chat.messages.append(ChatMessage("assistant", "the keeper climbs"))
    saver.message(chat, 2)
    saver.flush()
    assert [(h.chat_id, h.message_index) for h in store.search("keeper")] == [("c1", 2)]
    chat.messages[2].content = "the keeper sleeps"  # a streaming reply saved again: old words leave the index
    saver.message(chat, 2)
    saver.flush()
    assert store.search("climbs") == [] and len(store.search("sleeps")) == 1
    chat.is_open = False  # closed chats are searched too
    store.save_chat(chat)
    assert [h.is_open for h in store.search("sleeps")] == [False]

    saver.delete_chat("c1")
    saver.message(chat, 2)  # a late save of a deleted chat does not bring it back
    saver.flush()
    assert store.search("sleeps") == [] and store.search("lens") == [] and store.load_chat("c1") is None
    assert len(store.search("attention")) == 1
    store.close()
    assert len(Store.open(tmp_path).search("attention")) == 1


def test_a_reply_with_drafts_shows_and_saves_how_many_were_kept():
    from pagedchat.engine.records import Outcome
    from pagedchat.tui.conversation import stats_from_dict, stats_line, stats_to_dict

    stats = Outcome(generated_tokens=40, drafted_tokens=30, accepted_tokens=24, decode_tokens_per_s=50.0)
    assert "drafts 24/30 kept" in stats_line(stats)
    again = stats_from_dict(stats_to_dict(stats))
    assert (again.drafted_tokens, again.accepted_tokens) == (30, 24)
    assert "drafts" not in stats_line(Outcome(generated_tokens=40))
