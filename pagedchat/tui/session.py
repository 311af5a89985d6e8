"""A chat's live state in this run: its record plus what only matters while the engine runs.

turn_ids keeps the exact token ids of every finished exchange (prompt + generated ids) by the index of its
reply, so the next prompt, a regenerate, an edit or a branch can start from ids the engine has cached instead
of re-tokenised text (which may tokenise differently and miss the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedchat.tui.records import INTERRUPTED, ChatMessage, ChatRecord, ReplyStats


@dataclass(eq=False)
class ChatSession:
    record: ChatRecord
    colour: int = 0                            # index into the theme's chat colours
    request_id: str | None = None              # the live request, if a reply is being generated
    handle: object | None = None               # its RequestHandle
    reply_index: int | None = None             # the message the live request writes into
    reply_prefix: str = ""                     # text the reply had before this request (a forked branch)
    fork_parent_len: int | None = None         # forked branch: parent prompt length, to recover the prefix
    received_text: str = ""                    # text streamed by the live request so far
    received_tokens: int = 0
    turn_ids: dict[int, list[int]] = field(default_factory=dict)
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
        handle = self.handle
        return ReplyStats(prompt_tokens=len(handle.prompt_token_ids), cached_tokens=handle.cached_tokens,
                          generated_tokens=self.received_tokens, ttft=handle.time_to_first_token,
                          tokens_per_s=handle.decode_tokens_per_s, finish_reason=finish_reason)

    def reply_snapshot(self) -> ChatMessage:
        """The live reply as saved while it is written: its text so far, marked interrupted, which is what
        it is if the app dies before the next save. The final save replaces it under the same id."""
        message = self.record.messages[self.reply_index]
        return ChatMessage(message.role, message.content, self.live_stats(INTERRUPTED), message.id)

    def previous_ids(self, upto: int) -> list[int] | None:
        """Token ids of the latest exchange whose reply comes before message `upto`."""
        earlier = [i for i in self.turn_ids if i < upto]
        return self.turn_ids[max(earlier)] if earlier else None

    def truncate(self, count: int) -> list[ChatMessage]:
        """Drop messages from index `count` on, with the token ids that covered them; returns the dropped."""
        dropped = self.record.messages[count:]
        del self.record.messages[count:]
        self.turn_ids = {i: ids for i, ids in self.turn_ids.items() if i < count}
        return dropped

    def prefix_pages(self, ids: list[int] | None, block_size: int) -> tuple[int, ...]:
        """The full pages of `ids` among the remembered pages, when the last request's tokens start with ids."""
        if not ids or not self.pages:
            return ()
        last = self.turn_ids[max(self.turn_ids)] if self.turn_ids else None
        if last is None or last[:len(ids)] != ids:
            return ()
        return self.pages[:len(ids) // block_size]
