"""Plain records that cross every layer: how a reply ended, and what a page holds. No behaviour, no imports of
the engine's machinery, so the app and the server can name them without reaching into the engine."""

from __future__ import annotations

import enum


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


class PageState(enum.Enum):
    FREE = "free"        # holds nothing reusable
    USED = "used"        # mapped by at least one block table (or pinned as a copy source)
    CACHED = "cached"    # no user left, content kept under its hash until evicted


# A block table's entry for a page that a sliding window released: nothing is mapped there (the model runner
# points the kernels at its layer group's null page instead; engine/block_manager.py, release_outside_window).
NULL_PAGE = -1
