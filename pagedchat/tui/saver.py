"""What this instance changed, on its way to the store.

The app marks what it changed (a chat's row, one message, removed messages, tab order, a setting) and calls
flush(). Only marked things are written, so an instance never writes back another instance's chats from a
stale copy. A write that fails (disk full, the file read-only, a lock held past the busy timeout) raises
nothing: the marks stay, the user is told once, and the next flush (the app retries on a timer) writes them.
The records in memory are the truth until then, so nothing is lost while the app runs.

A streaming reply's snapshots are written apart (flush_soon), on a thread of the saver's own with a connection of
its own: a commit waits on the disk's syncs, and the UI thread, keys included, would wait with it twice a second.
Every other write is made at once on the UI thread, after the one in flight has ended, so writes land in the
order they were made.
"""

from __future__ import annotations

import sqlite3
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagedchat.tui.conversation import ChatMessage, ChatRecord, slug
from pagedchat.tui.db import connect, describe
from pagedchat.tui.store import Store
from pagedchat.tui.transfer import to_json

RETRY_S = 2.0       # how often the app retries a failed write
RETRY_WAIT_S = 0.1  # how long a retry waits for a lock: the UI thread waits with it, every RETRY_S
Report = Callable[[str, str], None]  # (text, severity)


@dataclass
class _Changes:
    """One chat's unsaved changes."""

    record: ChatRecord
    row: bool = False                                                      # title, settings, tab place
    messages: dict[str, tuple[int, ChatMessage]] = field(default_factory=dict)  # id -> (index, message)
    removed: set[str] = field(default_factory=set)
    draft: str | None = None                                               # the input's text, when it changed

    def fill_from(self, older: _Changes) -> None:
        """Add an older write's changes that these newer ones do not replace (the older write failed)."""
        self.row = self.row or older.row
        for message_id, entry in older.messages.items():
            if message_id not in self.messages and message_id not in self.removed:
                self.messages[message_id] = entry
        self.removed |= older.removed - self.messages.keys()
        if self.draft is None:
            self.draft = older.draft


@dataclass
class _Marks:
    """What is marked and not yet written: what one write takes."""

    chats: dict[str, _Changes] = field(default_factory=dict)
    order: list[str] | None = None
    state: dict[str, str] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)

    @property
    def empty(self) -> bool:
        return not (self.chats or self.deleted or self.order is not None or self.state)

    def fill_from(self, older: _Marks, gone: set[str]) -> None:
        """Take back a failed write's marks, under the ones made since (which are newer)."""
        for chat_id, changes in older.chats.items():
            if chat_id not in gone:
                self.chats.setdefault(chat_id, _Changes(changes.record)).fill_from(changes)
        self.order = self.order if self.order is not None else older.order
        self.state = {**older.state, **self.state}
        self.deleted |= older.deleted


class Saver:
    def __init__(self, store: Store, report: Report) -> None:
        self.store = store
        self._report = report
        self._marks = _Marks()
        self._gone: set[str] = set()       # deleted chats: a late mark must not bring one back
        self._writer: ThreadPoolExecutor | None = None   # flush_soon's thread, made at its first write
        self._writer_store: Store | None = None          # that thread's own connection to the file
        self._in_flight: tuple[Future, _Marks] | None = None
        self._drafts: dict[str, str] = {}  # each chat's input as last marked or read: unchanged ones are not written
        self.failing: str | None = None    # the last write error, while writes fail

    # ---- marking --------------------------------------------------------------------------------------------
    def _changes(self, record: ChatRecord) -> _Changes:
        if record.id in self._gone:
            return _Changes(record)  # marked, and never written
        changes = self._marks.chats.setdefault(record.id, _Changes(record))
        changes.record = record
        return changes

    def chat(self, record: ChatRecord, *, messages: bool = False) -> None:
        """The chat's own row changed; messages=True: every message too (a new or reopened chat, a branch)."""
        changes = self._changes(record)
        changes.row = True
        if messages:
            for index, message in enumerate(record.messages):
                self.message(record, index, message)

    def message(self, record: ChatRecord, index: int, message: ChatMessage | None = None) -> None:
        """Message `index` of the chat, or `message` in its place (a snapshot of a reply being written)."""
        message = message if message is not None else record.messages[index]
        changes = self._changes(record)
        changes.messages[message.id] = (index, message)
        changes.removed.discard(message.id)

    def removed(self, record: ChatRecord, messages: list[ChatMessage]) -> None:
        changes = self._changes(record)
        for message in messages:
            changes.messages.pop(message.id, None)
            changes.removed.add(message.id)

    def draft(self, record: ChatRecord, text: str, *, saved: bool = False) -> None:
        """The chat's unsent input, marked if it changed since last seen; saved=True: as read from the store."""
        if self._drafts.get(record.id, "") == text:
            return
        self._drafts[record.id] = text
        if not saved:
            self._changes(record).draft = text

    def delete_chat(self, chat_id: str) -> None:
        """Delete the chat for good; anything still unsaved of it is dropped."""
        self._marks.chats.pop(chat_id, None)
        self._marks.deleted.add(chat_id)
        self._gone.add(chat_id)

    def order(self, open_ids: list[str]) -> None:
        self._marks.order = list(open_ids)

    def state(self, key: str, value: str) -> None:
        self._marks.state[key] = value

    @property
    def pending(self) -> bool:
        return not self._marks.empty or self._in_flight is not None

    def unsaved_chats(self) -> list[ChatRecord]:
        """The chats with changes not written yet: what quitting now would lose."""
        marked = [self._marks] + ([self._in_flight[1]] if self._in_flight is not None else [])
        return list({chat_id: changes.record for marks in reversed(marked)
                     for chat_id, changes in marks.chats.items()}.values())

    # ---- writing --------------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Write everything marked, in one transaction. False (and the marks kept) if the write failed.
        While writes fail, only retry() writes: each change would otherwise wait out the busy timeout."""
        self._settle()
        if self.failing is not None:
            return False
        return self._flush()

    def flush_soon(self) -> None:
        """Write everything marked on the saver's thread, and return at once. Where a write is still in flight,
        the marks wait for the next call; while writes fail, for retry()."""
        if self._in_flight is not None and not self._in_flight[0].done():
            return
        self._settle()
        if self.failing is not None or self._marks.empty:
            return
        if not self.store.keeps_chats:   # in memory: no second connection sees it, and no disk to wait on
            self._flush()
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedchat-saver")
        marks, self._marks = self._marks, _Marks()
        wait_ms = self.store.conn.execute("PRAGMA busy_timeout").fetchone()[0]   # as long as the store would
        self._in_flight = (self._writer.submit(self._write_apart, marks, wait_ms / 1000), marks)

    def retry(self, wait_s: float = RETRY_WAIT_S) -> bool:
        """Try again what failed (the app's timer), waiting at most wait_s for another writer's lock."""
        self._settle()
        if not self.pending:
            return True
        with self.store.busy_timeout(wait_s):
            return self._flush()

    def close(self) -> None:
        """Wait for the write in flight, then end the saver's thread and its connection."""
        self._settle()
        if self._writer is not None:
            self._writer.submit(self._close_writer_store).result()
            self._writer.shutdown()
            self._writer = None

    def _flush(self) -> bool:
        if self._marks.empty:
            return True
        try:
            with self.store.transaction():
                self._write(self.store, self._marks)
        except (sqlite3.Error, OSError) as exc:
            self._failed(describe(exc))
            return False
        self._marks = _Marks()
        self._written()
        return True

    def _settle(self) -> None:
        """Wait for the write in flight, if any, and take in how it went."""
        if self._in_flight is None:
            return
        future, marks = self._in_flight
        self._in_flight = None
        try:
            future.result()
        except (sqlite3.Error, OSError) as exc:
            self._marks.fill_from(marks, self._gone)
            self._failed(describe(exc))
            return
        self._written()

    def _written(self) -> None:
        if self.failing is not None:
            self.failing = None
            self._report("Chats are being saved again.", "information")

    def _write_apart(self, marks: _Marks, wait_s: float) -> None:
        """On the saver's thread, which alone uses its connection."""
        if self._writer_store is None:
            self._writer_store = Store(connect(self.store.path, wait_s), self.store.path)
        with self._writer_store.busy_timeout(wait_s), self._writer_store.transaction():
            self._write(self._writer_store, marks)

    def _close_writer_store(self) -> None:
        if self._writer_store is not None:
            self._writer_store.close()
            self._writer_store = None

    @staticmethod
    def _write(store: Store, marks: _Marks) -> None:
        for changes in marks.chats.values():
            record = changes.record
            if changes.row:
                record.updated = time.time()
                store.put_chat(record)
            elif changes.messages or changes.draft is not None:
                store.ensure_chat(record)
            for index, message in changes.messages.values():
                store.put_message(record.id, index, message)
            if changes.draft is not None:
                store.put_draft(record.id, changes.draft)
            if changes.removed:
                store.remove_messages(record.id, sorted(changes.removed))
        for chat_id in marks.deleted:
            store.remove_chat(chat_id)
        if marks.order is not None:
            store.put_order(marks.order)
        for key, value in marks.state.items():
            store.put_state(key, value)

    def _failed(self, reason: str) -> None:
        if self.failing == reason:
            return  # said once; the retries stay quiet until something changes
        self.failing = reason
        self._report(f"Could not save chats ({reason}). Retrying every {RETRY_S:.0f} s; nothing is lost while "
                     "pagedchat runs.", "error")


def export_chats(records: list[ChatRecord], folder: Path) -> list[Path]:
    """Each chat whole, as the JSON `pagedchat import` reads, into folder (made if missing): the way out when
    the chats cannot be saved where they live. Raises OSError when the folder cannot be written either."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for record in records:
        path = folder / f"{slug(record.title)}-{record.id[:8]}.json"   # the id: two "New chat"s both kept
        path.write_text(to_json(record), encoding="utf-8")
        paths.append(path)
    return paths
