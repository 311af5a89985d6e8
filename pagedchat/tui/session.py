"""A chat's live state in this run: its record plus what only matters while the backend runs.

turns keeps the Outcome of every finished exchange by the index of its reply. The next prompt, a regenerate,
an edit or a branch hands the one before it back to the backend, which reuses what it can: the local engine
starts from its exact token ids (re-tokenised text may tokenise differently and miss the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedchat.backends.base import Outcome
from pagedchat.tui.records import INTERRUPTED, ChatMessage, ChatRecord, ReplyStats


@dataclass(eq=False)
class ChatSession:
    record: ChatRecord
    colour: int = 0                            # index into the theme's chat colours
    request_id: str | None = None              # the live request, if a reply is being generated
    handle: object | None = None               # its ReplyHandle
    reply_index: int | None = None             # the message the live request writes into
    reply_prefix: str = ""                     # text the reply had before this request (a forked branch)
    inheriting: bool = False                   # a forked branch whose first update (the text it inherits) is due
    received_text: str = ""                    # text streamed by the live request so far
    received_tokens: int = 0
    turns: dict[int, Outcome] = field(default_factory=dict)
    pages: tuple[int, ...] = ()                # the pages its last request held (seen while it ran)
    page_tokens: int = 0
    unseen: bool = False                       # a reply finished while the tab was not in view
    saved_at: float = 0.0                      # monotonic time the live reply was last saved

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def busy(self) -> bool:
        return self.request_id is not None

    def live_stats(self, finish_reason: str) -> ReplyStats:
        """The live reply's stats line as it stands, ended by `finish_reason`."""
        return replace(ReplyStats.from_outcome(self.handle.so_far()), generated_tokens=self.received_tokens,
                       finish_reason=finish_reason)

    def reply_snapshot(self) -> ChatMessage:
        """The live reply as saved while it is written: its text so far, marked interrupted, which is what
        it is if the app dies before the next save. The final save replaces it under the same id."""
        message = self.record.messages[self.reply_index]
        return ChatMessage(message.role, message.content, self.live_stats(INTERRUPTED), message.id)

    def previous(self, upto: int) -> Outcome | None:
        """The latest exchange whose reply comes before message `upto`."""
        earlier = [i for i in self.turns if i < upto]
        return self.turns[max(earlier)] if earlier else None

    def truncate(self, count: int) -> list[ChatMessage]:
        """Drop messages from index `count` on, with the turns that covered them; returns the dropped."""
        dropped = self.record.messages[count:]
        del self.record.messages[count:]
        self.turns = {i: turn for i, turn in self.turns.items() if i < count}
        return dropped

    def turns_before(self, index: int) -> dict[int, Outcome]:
        return {i: turn for i, turn in self.turns.items() if i < index}
