"""Plain records that cross every layer: a reply's updates and outcome, the face of a reply in flight, how a
reply ended, and what a page holds. No imports of the engine's machinery, so the app and the
server can name them without reaching into the engine.

One reply speaks one vocabulary from the engine to the screen and the wire: the engine streams `Update`s and
ends with an `Outcome`; the backends pass them on as they are (a fork's first update adds the text it
inherits, a remote server's adds a notice); the server turns them into chunks, and the app saves an
Outcome's figures under each reply.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class FinishReason(enum.StrEnum):
    """How a reply ended. The values are the words chats.db has always saved, so old chats load as they are;
    `pagedchat serve` maps them to OpenAI's wire words (serve/responses.py), RemoteBackend maps them back."""

    STOP = "stop"                  # an end-of-sequence token, a stop token or a stop string
    LENGTH = "length"              # the request's max_tokens
    CONTEXT_FULL = "context_full"  # the model's context length: no room for another token
    TOOL_CALLS = "tool_calls"      # a server ended the reply to call tools (the engine stops with STOP)
    CANCELLED = "cancelled"        # stopped by its caller, or by the engine closing
    ERROR = "error"                # failed; the record's error says why
    INTERRUPTED = "interrupted"    # the app's: saved while still being written (a crash, a closed terminal)

    @classmethod
    def read(cls, word: str | None) -> FinishReason | None:
        """A word from outside: saved in chats.db, or a server's. A server's other words ("content_filter"...,
        saved as they came before this enum) mean it ended the reply by its own rule, which reads as STOP."""
        if word is None:
            return None
        try:
            return cls(word)
        except ValueError:
            return cls.STOP


# A block table's entry for a page that a sliding window released: nothing is mapped there (the model runner
# points the kernels at its layer group's null page instead; engine/block_manager.py, release_outside_window).
NULL_PAGE = -1


class PageState(enum.Enum):
    FREE = "free"        # holds nothing reusable
    USED = "used"        # mapped by at least one block table (or pinned as a copy source)
    CACHED = "cached"    # no user left, content kept under its hash until evicted


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Sampled:
    """The token a row picked; its log-probability and the likeliest alternatives where asked for."""

    token: int
    logprob: TokenLogprob | None = None
    top: tuple[TokenLogprob, ...] = ()
    error: str | None = None   # the grammar refused the token: the request fails with this


@dataclass(frozen=True)
class Outcome:
    """A reply's result: final in its last Update, or its figures so far (finish_reason None) from
    ReplyHandle.so_far(). Every backend fills the text, the reason and the figures; the token ids, pages and
    log-probabilities only where it sees them (the engine, and the backends over it)."""

    request_id: str = ""
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None           # why, when the reason is ERROR
    prompt_tokens: int = 0
    cached_tokens: int = 0             # prompt tokens whose K/V came from the prefix cache
    prefilled_tokens: int = 0          # prompt tokens it computed (past prompt - cached after a recompute)
    generated_tokens: int = 0
    time_to_first_token: float | None = None
    decode_tokens_per_s: float | None = None
    counted: bool = True               # False: a server sent no usage, so the token figures are not counts
    drafted_tokens: int = 0            # speculative decoding's draft tokens verified (docs/speculative.md)
    accepted_tokens: int = 0           # of those, tokens kept
    # Where the backend sees them. Lists, as the engine's callers compare them with lists of ids.
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)   # generated ids only, EOS included (as transformers)
    pages: tuple[int, ...] = ()        # the block table just before the pages were released
    logprobs: tuple[Sampled, ...] = ()  # one per generated token, where asked for

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def history_ids(self) -> list[int]:
        """Prompt and reply ids: the next turn's prompt starts with them, so its prefix is found in the cache."""
        return self.prompt_token_ids + self.token_ids


@dataclass(frozen=True)
class Update:
    """What a reply added since the last update. The engine fills the ids; a backend over it adds what only it
    knows: a fork's inherited text, a notice for the user."""

    request_id: str
    text: str = ""
    tokens: int = 0                    # tokens it adds (a remote server's: the pieces it streamed)
    token_ids: tuple[int, ...] = ()    # those tokens' ids, where the backend sees them
    logprobs: tuple[Sampled, ...] = ()  # those tokens' log-probabilities, where asked for
    inherited: str | None = None       # a fork's first update: the parent reply's text it continues ("" = none)
    notices: tuple[str, ...] = ()      # something the user should be told about this reply
    outcome: Outcome | None = None     # set on the last update only

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @classmethod
    def merge(cls, updates: list[Update]) -> Update:
        """A batch of one reply's updates as one (the app draws a batch at a time)."""
        return cls(updates[0].request_id, "".join(u.text for u in updates), sum(u.tokens for u in updates),
                   tuple(t for u in updates for t in u.token_ids), tuple(s for u in updates for s in u.logprobs),
                   next((u.inherited for u in updates if u.inherited is not None), None),
                   tuple(dict.fromkeys(n for u in updates for n in u.notices)),
                   next((u.outcome for u in updates if u.finished), None))


@runtime_checkable
class ReplyHandle(Protocol):
    """A reply in flight, wherever it is written: the engine's RequestHandle, the engine process's ProcessHandle
    and a server's RemoteHandle. Its Updates go to the on_update given when it was started."""

    request_id: str

    def cancel(self) -> None:
        """Stop the reply; its final Update (FinishReason.CANCELLED) still comes."""

    def so_far(self) -> Outcome:
        """The figures up to now, for a reply abandoned before its final update. Never waits."""

    def result(self, timeout: float | None = None) -> Outcome:
        """Wait for the final outcome."""
