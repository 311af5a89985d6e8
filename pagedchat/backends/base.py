"""The one face the app sees of whatever writes its replies.

A backend takes chat messages (with the outcome of the turn before, so it can reuse what that turn computed),
streams Updates (engine/records.py, the one vocabulary of a reply) to a callback on a thread of its own, forks a
live reply, and reports memory. The app never tokenizes, never reads an engine's internals and never asks which
kind of backend it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Union, runtime_checkable

from pagedchat.backends.remote_metrics import ServerMetrics
from pagedchat.engine.records import Outcome, ReplyHandle, Update

if TYPE_CHECKING:  # the face names the engine's records without loading the engine's modules
    from pagedchat.engine.core_loan import CoreLoan
    from pagedchat.engine.kv_snapshot import MemorySnapshot, PoolUsage
    from pagedchat.engine.params import SamplingParams
    from pagedchat.engine.structured import CompiledGrammar, GrammarSpec


@dataclass(frozen=True)
class BackendInfo:
    """What the status line and the inspector say about the model; None where the backend cannot know."""

    model: str
    where: str                      # "on cpu · float32", "via http://127.0.0.1:8000/v1"
    context_length: int | None = None
    block_size: int | None = None   # tokens per page
    num_pages: int | None = None
    page_bytes: int | None = None
    # Every layer group's pages in bytes (engine/page_groups.py): with sliding-window layers, whose pools are
    # smaller, less than num_pages * page_bytes.
    pool_bytes: int | None = None
    vocab_size: int | None = None   # token ids run 0..vocab_size-1 (logit_bias, stop_token_ids name them)


@dataclass(frozen=True)
class MemoryUnavailable:
    """The backend can show no memory picture; `reason` is the one line the inspector prints."""

    reason: str


# What memory() returns: the full page map (the local engine, `pagedchat serve`), server-wide figures from
# Prometheus metrics (vLLM), or a line saying there is nothing to show.
MemoryView = Union["MemorySnapshot", ServerMetrics, "MemoryUnavailable"]
OnUpdate = Callable[[Update], None]
Progress = Callable[[str, "float | None"], None]   # (stage, fraction done or None) while a backend loads


@runtime_checkable
class Backend(Protocol):
    info: BackendInfo
    failure: str | None   # why it stopped for good (the local engine's loop broke), else None
    core_loan: CoreLoan | None   # where the UI borrows a core from the engine's steps (the engine's process)

    def submit(self, messages: list[dict], params: "SamplingParams", *, previous: Outcome | None = None,
               on_update: OnUpdate | None = None) -> ReplyHandle:
        """Start a reply to `messages` (the last one the user's). Raises PagedChatError when it cannot start."""

    def prompt_tokens(self, messages: list[dict], previous: Outcome | None = None) -> int | None:
        """The prompt's size in tokens, where the backend can count it (None: only the backend's refusal tells).
        It may wait on the engine (the engine process's answer): never call it on the UI thread."""

    def fork(self, parent: ReplyHandle, params: "SamplingParams", *,
             on_update: OnUpdate | None = None) -> ReplyHandle:
        """A new reply continuing `parent`'s text so far. Raises PagedChatError when it cannot fork."""

    def memory(self) -> MemoryView:
        """The latest memory picture; never waits on the network (the UI thread calls it on a timer)."""

    def stalled_for(self) -> float | None:
        """How long the engine has not been heard from, once that is long enough to say it has stopped answering
        (its process stopped or starved); None while it answers, or where the backend cannot tell."""

    def shutdown(self) -> None: ...


@runtime_checkable
class TokenBackend(Backend, Protocol):
    """A backend whose tokenizer and engine run in this process (LocalBackend). `pagedchat serve` and the bench
    need this much more: they pass prompts as token ids (an HTTP client may send ids; the bench times the same
    ids on every runner), start several requests in one step, and read the pool at every update."""

    def prompt_ids(self, prompt: str | list[int] | list[dict], previous: Outcome | None = None, *,
                   continue_final: bool = False, parse_special: bool = False) -> list[int]:
        """A text's ids or token ids, checked against the vocabulary (the context is the caller's to compare,
        and submit_ids checks it); or chat messages' through the model's template, reusing previous's ids
        (continue_final: the last, assistant, message is continued rather than answered). Only the template's
        markers become control tokens: a text's special tokens are read as text unless parse_special. Raises
        PagedChatError when the prompt cannot be built."""

    def submit_ids(self, prompts: list[list[int]], params: "SamplingParams", *,
                   request_ids: list[str] | None = None, on_update: OnUpdate | None = None,
                   n: int = 1) -> list[ReplyHandle]:
        """n replies per prompt (in prompt order), all admitted in the same step; a prompt's n replies share its
        pages. Raises PagedChatError (and starts none) when one of them can never run."""

    def compile_grammar(self, spec: "GrammarSpec") -> "CompiledGrammar":
        """spec compiled for the model's tokenizer (cached; slow the first time: call it off the event loop).
        Raises PagedChatError naming what is wrong with it."""

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (log-probabilities name tokens by it)."""

    def usage(self) -> "PoolUsage":
        """Steps run and pages in use: cheap enough to read in every on_update."""

    def memory(self) -> "MemorySnapshot": ...


def refusal(handle: ReplyHandle) -> Exception | None:
    """Why the backend would not start this reply, where it said so after returning its handle (the engine
    process: submit and fork do not wait for its answer). Its one update then ends it as an error; this tells
    that apart from a reply that failed once started. None for any other reply."""
    return getattr(handle, "refusal", None)


def has_page_map(view: MemoryView) -> bool:
    """True for a MemorySnapshot: told apart from the other two kinds, which import no torch."""
    return not isinstance(view, (ServerMetrics, MemoryUnavailable))


def request_pages(view: MemoryView, request_id: str) -> tuple[tuple[int, ...], int] | None:
    """(pages, tokens) a live request holds, where the memory view shows them by request id."""
    seq = view.seqs.get(request_id) if has_page_map(view) else None
    return (tuple(seq.pages), seq.num_tokens) if seq is not None and seq.pages else None
