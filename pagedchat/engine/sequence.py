"""A request's tokens, its place in the cache, and what it reports back (an Outcome, engine/records.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedchat.engine.params import SamplingParams
from pagedchat.engine.records import FinishReason, Outcome, Sampled, Update

if TYPE_CHECKING:  # the bookkeeping never touches torch; only the sampler uses the generator
    import torch


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # not admitted yet, or preempted for recompute
    RUNNING = "running"    # holds GPU pages
    SWAPPED = "swapped"    # preempted; its pages sit in the CPU tier
    FINISHED = "finished"


@dataclass
class PageTable:
    """A sequence's pages in one layer group (engine/page_groups.py): one per group, as vLLM's hybrid allocator
    keeps them. A model without sliding windows has one group, and so one table."""

    block_table: list[int] = field(default_factory=list)   # GPU pages in logical order; NULL_PAGE where released
    page_hashes: list[int] = field(default_factory=list)   # chain hash of each full page, in order
    cpu_table: list[int] = field(default_factory=list)     # CPU-tier pages while SWAPPED; NULL_PAGE where released


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]                 # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    group: str = ""                      # the request it answers: the n replies to one prompt share the first's id
    status: SeqStatus = SeqStatus.WAITING  # written by the scheduler alone (engine/scheduler.py)
    num_computed: int = 0                # leading tokens whose K/V are in the cache (Scheduler.set_computed)
    tables: list[PageTable] = field(default_factory=lambda: [PageTable()])  # one per layer group
    generator: torch.Generator | None = None
    matcher: object | None = None        # llguidance.LLMatcher of a constrained reply (structured.py)
    sampled: list[Sampled] = field(default_factory=list)  # each output token's log-probabilities, if asked
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    prefix_counted: bool = False         # its prefix-cache lookup is counted (once, at its first admission)
    inherited: str | None = None         # a fork's: the parent's reply text it starts from, until its first update
    # Speculative decoding (engine/ngram.py, whose Speculation keeps the drafting state): the draft tokens it
    # verified and kept.
    drafted: int = 0
    accepted: int = 0

    @property
    def request(self) -> str:
        """The request whose share of the batch this sequence counts against (engine/scheduler.py)."""
        return self.group or self.request_id

    def table(self, group: int) -> PageTable:
        """The table of a layer group, made empty on first use (a sequence does not know its model's groups)."""
        while len(self.tables) <= group:
            self.tables.append(PageTable())
        return self.tables[group]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.value}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed}, pages={self.tables[0].block_table})")

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def timing(self) -> tuple[float | None, float | None]:
        """(time to first token, decode tokens/s) so far."""
        ttft = (self.first_token_time - self.arrival) if self.first_token_time else None
        n_out = len(self.token_ids) - self.num_prompt_tokens
        tps = None
        if self.first_token_time and self.last_token_time and n_out > 1:
            span = self.last_token_time - self.first_token_time
            tps = (n_out - 1) / span if span > 0 else None
        return ttft, tps

    def figures(self) -> Outcome:
        """The figures so far, without the ids (which would copy every token on every step)."""
        ttft, tps = self.timing()
        return Outcome(self.request_id, prompt_tokens=self.num_prompt_tokens, cached_tokens=self.cached_tokens,
                       prefilled_tokens=self.prefilled_tokens,
                       generated_tokens=len(self.token_ids) - self.num_prompt_tokens,
                       time_to_first_token=ttft, decode_tokens_per_s=tps, drafted_tokens=self.drafted,
                       accepted_tokens=self.accepted)

    def outcome(self, text: str) -> Outcome:
        """Everything it has, with its reply's text (the detokenizer's): the final Outcome once it has a finish
        reason."""
        return replace(self.figures(), text=text, finish_reason=self.finish_reason, error=self.error,
                       prompt_token_ids=self.token_ids[:self.num_prompt_tokens], token_ids=list(self.output_ids),
                       pages=tuple(self.tables[0].block_table), logprobs=tuple(self.sampled))

    def update(self, text: str, token_ids=(), logprobs=(), outcome: Outcome | None = None) -> Update:
        """What a step added; a fork's first also says what it inherited."""
        inherited, self.inherited = self.inherited, None
        return Update(self.request_id, text, len(token_ids), tuple(token_ids), tuple(logprobs), inherited=inherited,
                      outcome=outcome)
