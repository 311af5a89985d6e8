"""The reply a chat is writing: the request behind it and what it has streamed, from start to its end.

Plain state and its rules, no widgets: the chat's view (chat_view.py) renders what these methods return. A
reply ends once, by finish (the backend's final update) or abandon (stopped without waiting for it); from that
moment it takes no more updates, and end() clears it after the screen and the disk show the result, so that
whatever waits on `live` sees the finished reply in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

from pagedchat.engine.records import FinishReason, Outcome, ReplyHandle, Update
from pagedchat.tui.conversation import ChatMessage, ChatSettings, reply_stats


@dataclass(frozen=True)
class Ending:
    """How a reply ended, as the chat shows it: the message it wrote into, that message's final text (a fork's
    starts with its parent's), and the figures its stats line shows."""

    index: int
    content: str
    stats: Outcome


@dataclass(frozen=True)
class Replaced:
    """What starting a reply took out of its chat (the messages from `keep` on, their turns, the title) and the
    user's new message it sent: put back if the backend refuses the reply after taking it."""

    keep: int
    messages: list[ChatMessage]
    turns: dict[int, Outcome]
    title: str
    ask: str | None


@dataclass(eq=False)
class Reply:
    handle: ReplyHandle | None = None  # the live request, if any
    index: int | None = None           # the message the live request writes into
    prefix: str = ""                   # text the message had before this request (a forked branch)
    inheriting: bool = False           # a forked branch whose first update (the text it inherits) is due
    text: str = ""                     # text streamed by this request so far
    tokens: int = 0
    saved_at: float = 0.0              # monotonic time its snapshot was last saved
    taking: bool = False               # still takes updates: false once it has ended
    replaced: Replaced | None = None   # what its start changed in the chat (None: a forked branch)
    # The reply line's tok/s is what the user saw: tokens over the time from the first batch the app took in
    # to the last, on its own clock, not the engine's rate (which the app's work on the same cores lowers).
    clock: Callable[[], float] = time.monotonic
    first_at: float | None = None      # when the first tokens came in
    first_tokens: int = 0              # how many came with them: the rate counts those after
    last_at: float | None = None       # when the latest tokens came in

    @property
    def live(self) -> bool:
        return self.handle is not None

    @property
    def request_id(self) -> str | None:
        return self.handle.request_id if self.handle is not None else None

    @property
    def content(self) -> str:
        return self.prefix + self.text

    def tokens_held(self) -> int:
        """The live request's prompt and generated tokens, as they stand."""
        return self.handle.so_far().prompt_tokens + self.tokens

    def takes(self, request_id: str) -> bool:
        return self.taking and self.request_id == request_id

    def start(self, handle: ReplyHandle, index: int, *, prefix: str = "", inheriting: bool = False,
              replaced: Replaced | None = None) -> None:
        self.end()
        self.handle, self.index, self.prefix, self.inheriting, self.taking = handle, index, prefix, inheriting, True
        self.replaced = replaced

    def feed(self, updates: list[Update]) -> Update:
        """Take a batch of updates; what they add, as one."""
        fed = Update.merge(updates)
        if fed.inherited is not None:
            self.inheriting = False
            self.prefix += fed.inherited
        self.text += fed.text
        self.tokens += fed.tokens
        if fed.tokens:
            now = self.clock()
            if self.first_at is None:
                self.first_at, self.first_tokens = now, self.tokens
            self.last_at = now
        return fed

    def shown_rate(self) -> float | None:
        """Tokens a second as the app took them in, from the first tokens to the latest; None before a second
        batch (a reply that came all at once has no rate of its own)."""
        if self.first_at is None or self.last_at is None or self.last_at <= self.first_at:
            return None
        return (self.tokens - self.first_tokens) / (self.last_at - self.first_at)

    def stats(self, finish_reason: FinishReason, outcome: Outcome | None = None) -> Outcome:
        """The stats line's figures: final from the outcome, else as they stand, ended by finish_reason. The
        rate is the one shown (shown_rate), the engine's only where the app saw no rate of its own."""
        if outcome is not None:
            stats = reply_stats(outcome)
        else:
            stats = replace(reply_stats(self.handle.so_far()), generated_tokens=self.tokens,
                            finish_reason=finish_reason)
        shown = self.shown_rate()
        return stats if shown is None else replace(stats, decode_tokens_per_s=shown)

    def finish(self, outcome: Outcome) -> Ending:
        self.stop_taking()
        return Ending(self.index, self.prefix + outcome.text, self.stats(outcome.finish_reason, outcome))

    def abandon(self, shown: str) -> Ending:
        """Cancel without waiting for the final update. `shown` is the message's text now: a fork with no
        update yet keeps the parent's text it started with."""
        stats = self.stats(FinishReason.CANCELLED)  # before the cancel: the figures as they stand
        self.handle.cancel()
        self.stop_taking()
        return Ending(self.index, shown if self.inheriting else self.content, stats)

    def fork(self, backend, settings: ChatSettings, on_update) -> Reply:
        """A branch's reply continuing this one (the backend forks the request); raises what the backend does."""
        remaining = max(1, settings.max_tokens - self.tokens)
        branch = Reply()
        branch.start(backend.fork(self.handle, settings.params(max_tokens=remaining), on_update=on_update),
                     self.index, prefix=self.prefix, inheriting=True)
        return branch

    def snapshot(self, message: ChatMessage) -> ChatMessage:
        """The reply as saved while it is written: its text so far, marked interrupted, which is what it is if
        the app dies before the next save. The final save replaces it under the same id."""
        return ChatMessage(message.role, message.content, self.stats(FinishReason.INTERRUPTED), message.id)

    def stop_taking(self) -> None:
        """Take no more updates (the app is exiting and does not wait for them)."""
        self.taking = False

    def end(self) -> None:
        self.handle, self.index, self.prefix, self.inheriting = None, None, "", False
        self.text, self.tokens, self.taking, self.replaced = "", 0, False, None
        self.first_at, self.first_tokens, self.last_at = None, 0, None
