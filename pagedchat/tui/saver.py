"""What this instance changed, on its way to the store.

The app marks what it changed (a chat's row, one message, removed messages, tab order, a setting) and calls
flush(). Only marked things are written, so an instance never writes back another instance's chats from a
stale copy. A write that fails (disk full, the file read-only, a lock held past the busy timeout) raises
nothing: the marks stay, the user is told once, and the next flush (the app retries on a timer) writes them.
The records in memory are the truth until then, so nothing is lost while the app runs.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagedchat.tui.conversation import ChatMessage, ChatRecord, slug
from pagedchat.tui.db import describe
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


class Saver:
    def __init__(self, store: Store, report: Report) -> None:
        self.store = store
        self._report = report
        self._chats: dict[str, _Changes] = {}
        self._order: list[str] | None = None
        self._state: dict[str, str] = {}
        self._deleted: set[str] = set()
        self._gone: set[str] = set()       # deleted chats: a late mark must not bring one back
        self._drafts: dict[str, str] = {}  # each chat's input as last marked or read: unchanged ones are not written
        self.failing: str | None = None    # the last write error, while writes fail

    # ---- marking --------------------------------------------------------------------------------------------
    def _changes(self, record: ChatRecord) -> _Changes:
        if record.id in self._gone:
            return _Changes(record)  # marked, and never written
        changes = self._chats.setdefault(record.id, _Changes(record))
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
        self._chats.pop(chat_id, None)
        self._deleted.add(chat_id)
        self._gone.add(chat_id)

    def order(self, open_ids: list[str]) -> None:
        self._order = list(open_ids)

    def state(self, key: str, value: str) -> None:
        self._state[key] = value

    @property
    def pending(self) -> bool:
        return bool(self._chats or self._deleted or self._order is not None or self._state)

    def unsaved_chats(self) -> list[ChatRecord]:
        """The chats with changes not written yet: what quitting now would lose."""
        return [changes.record for changes in self._chats.values()]

    # ---- writing --------------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Write everything marked, in one transaction. False (and the marks kept) if the write failed.
        While writes fail, only retry() writes: each change would otherwise wait out the busy timeout."""
        if self.failing is not None:
            return False
        return self._flush()

    def retry(self, wait_s: float = RETRY_WAIT_S) -> bool:
        """Try again what failed (the app's timer), waiting at most wait_s for another writer's lock."""
        if not self.pending:
            return True
        with self.store.busy_timeout(wait_s):
            return self._flush()

    def _flush(self) -> bool:
        if not self.pending:
            return True
        try:
            with self.store.transaction():
                self._write()
        except (sqlite3.Error, OSError) as exc:
            self._failed(describe(exc))
            return False
        self._chats.clear()
        self._deleted.clear()
        self._order = None
        self._state.clear()
        if self.failing is not None:
            self.failing = None
            self._report("Chats are being saved again.", "information")
        return True

    def _write(self) -> None:
        store = self.store
        for changes in self._chats.values():
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
        for chat_id in self._deleted:
            store.remove_chat(chat_id)
        if self._order is not None:
            store.put_order(self._order)
        for key, value in self._state.items():
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
