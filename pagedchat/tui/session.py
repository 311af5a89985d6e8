"""A chat's live state in this run: its record plus what only matters while the backend runs.

turns keeps the Outcome of every finished exchange by the index of its reply. The next prompt, a regenerate,
an edit or a branch hands the one before it back to the backend, which reuses what it can: the local engine
starts from its exact token ids (re-tokenised text may tokenise differently and miss the prefix cache).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field

from pagedchat.engine.records import Outcome
from pagedchat.tui.conversation import ChatMessage, ChatRecord
from pagedchat.tui.reply import Replaced, Reply


@dataclass(eq=False)
class ChatSession:
    record: ChatRecord
    colour: int = 0                            # index into the theme's chat colours
    reply: Reply = field(default_factory=Reply)  # the reply being written, if any
    turns: dict[int, Outcome] = field(default_factory=dict)
    pages: tuple[int, ...] = ()                # the pages its last request held (seen while it ran)
    page_tokens: int = 0
    unseen: bool = False                       # a reply finished while the tab was not in view

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def busy(self) -> bool:
        return self.reply.live

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

    def replacing(self, keep: int, ask: str | None) -> Replaced:
        """What a reply to the first `keep` messages (and `ask`) replaces, to put back if it is refused."""
        return Replaced(keep, self.record.messages[keep:], {i: t for i, t in self.turns.items() if i >= keep},
                        self.record.title, ask)

    def put_back(self, replaced: Replaced) -> list[ChatMessage]:
        """The chat as it was before a refused reply's start; returns the messages that start added."""
        added = self.truncate(replaced.keep)
        self.record.messages += replaced.messages
        self.turns.update(replaced.turns)
        self.record.title = replaced.title
        return added

    def turns_before(self, index: int) -> dict[int, Outcome]:
        return {i: turn for i, turn in self.turns.items() if i < index}


def branch_record(src: ChatRecord, messages: list[ChatMessage]) -> ChatRecord:
    """A branch of `src` holding `messages`: its title marked, its system prompt and settings copied."""
    return ChatRecord(title=f"↳ {src.title}"[:40], system_prompt=src.system_prompt,
                      settings=deepcopy(src.settings), messages=messages)


def inherited_pages(turn: Outcome | None, block_size: int | None) -> tuple[tuple[int, ...], int]:
    """The pages (and their tokens) a branch starts out owning: the full pages of the exchange it copies,
    cached ones in the map; none where the backend shows no pages."""
    if turn is None or not turn.pages or not block_size:
        return (), 0
    pages = turn.pages[:turn.total_tokens // block_size]
    return pages, len(pages) * block_size
