"""The engine's rules, free of torch: requests in, one step's bookkeeping, finished requests out.

Engine (engine.py) wraps this core with its compute thread, the model runner and the sampler; the tests'
FakeEngine wraps it with a fake model, so both run the same step (run_step: the phases in order, over a
ModelStep) and the same rules for num_computed, token appends, stops, frees, forks and faults. The caller holds
the engine's lock around every call but run_step, which takes the lock and holds it only around the
bookkeeping, not the model's work.

A fault in a phase that serves the whole batch (planning, page copies, forward, sampling) fails the requests
of that step and those whose pages its copies were moving; a fault in a phase of one request (sampling its row,
detokenizing, its bookkeeping) fails that request. Every other request carries on (abort_step).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from typing import Callable, ContextManager, Protocol

from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.detokenizer import Detokenizer
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.records import FinishReason, Sampled, Update
from pagedchat.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from pagedchat.engine.sequence import SeqStatus, Sequence
from pagedchat.errors import RequestError

log = logging.getLogger("pagedchat.engine")

HISTORY_LIMIT = 1024  # finished requests whose tokens fork() can still continue


class Phase(enum.Enum):
    """The phases of one step, in order. The first four serve the batch, the last two one request each."""

    SCHEDULE = "planning"
    COPY = "page copies"
    FORWARD = "forward pass"
    SAMPLE = "sampling"
    DETOKENIZE = "detokenizing"
    BOOKKEEPING = "bookkeeping"


# Called as each phase ends, with the request id for the per-request phases: a test's hook raises there to
# inject a fault with everything that phase changed left in place (the hardest point to recover from).
FaultHook = Callable[[Phase, "str | None"], None]
Output = tuple[Sequence, Update]


class ModelStep(Protocol):
    """The model's part of a step, run without the engine's lock: the Engine's ModelRunner and Sampler, or the
    tests' fake model. A phase raises to fail the step's requests (EngineCore.abort_step)."""

    def copy_pages(self, ops) -> None:
        """The plan's page copies: swap-outs, swap-ins, copy-on-write."""

    def forward(self, plan: StepPlan) -> object:
        """One forward pass over every scheduled chunk: its logits."""

    def sample(self, plan: StepPlan, logits: object) -> list[Sampled | Exception]:
        """A token per sampling row (or the exception that row raised, which fails that request only)."""


class EngineCore:
    def __init__(self, pages: PageGroups, scheduler: Scheduler, detokenizer: Detokenizer,
                 eos_token_ids: frozenset[int], max_context: int, fault_hook: FaultHook | None = None):
        self.pages = pages
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.fault_hook = fault_hook
        self.phase = Phase.SCHEDULE            # the phase this step reached
        self.steps = 0                          # steps that ran a forward pass
        self._live: dict[str, Sequence] = {}
        self._outputs: list[Output] = []        # postprocess's outputs so far: a fault there must not lose them
        self._history: dict[str, tuple[list[int], int]] = {}   # finished: (tokens, prompt length)
        # n > 1: the siblings of a parent request, waiting for its prompt to be computed to fork from it.
        self._pending: dict[str, list[Sequence]] = {}

    # ---- requests --------------------------------------------------------------------------------------
    def sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request (queued, running or swapped out), or None."""
        return self._live.get(request_id)

    def tokens_of(self, request_id: str) -> list[int] | None:
        """A live request's tokens so far, or a recently finished one's: what fork() continues."""
        seq = self._live.get(request_id)
        if seq is not None:
            return list(seq.token_ids)
        return list(self._history[request_id][0]) if request_id in self._history else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def check_fits(self, ids: list[int], params: SamplingParams) -> None:
        longest = min(len(ids) + params.max_tokens, self.max_context)
        need = self.pages.pages_for(longest)
        if need > self.pages.num_pages:
            raise RequestError(
                f"this request can grow to {longest} tokens ({need} pages) but the KV cache holds "
                f"{self.pages.num_pages} pages of {self.pages.block_size}: lower max_tokens or raise "
                "kv_cache_memory")

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._live:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        self._live[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_group(self, parent: Sequence, siblings: list[Sequence]) -> None:
        """parent and its siblings sample from the same prompt (n > 1): the prompt is computed once, by the
        parent, and each sibling then maps its pages copy-on-write and samples its own first token."""
        self.add(parent)
        for sib in siblings:
            if sib.request_id in self._live:
                raise RequestError(f"request id {sib.request_id!r} is already in use")
            self._live[sib.request_id] = sib
        self._pending[parent.request_id] = list(siblings)

    def _release_siblings(self, parent: Sequence) -> None:
        """The parent's prompt is computed: its live siblings share every prompt page but the last token's,
        which each computes again to get its own logits (writing it copies a shared page first). A parent that
        ended before that leaves them to prefill on their own, through the prefix cache."""
        computed = parent.num_computed >= parent.num_prompt_tokens and parent.status is SeqStatus.RUNNING
        for sib in self._pending.pop(parent.request_id, []):
            if self._live.get(sib.request_id) is not sib:
                continue  # cancelled meanwhile
            if computed and len(self.scheduler.running) < self.scheduler.max_seqs:
                shared = parent.num_prompt_tokens - 1
                self.scheduler.set_computed(sib, shared)
                self.pages.fork_prefix(parent, sib, shared)
                sib.prefix_counted = True
                sib.cached_tokens = shared
                self.scheduler.add_running(sib)
            else:
                self.scheduler.add(sib)

    def fork(self, child: Sequence, parent_id: str) -> Output | None:
        """Start child from the parent's tokens: a live parent shares its pages (copy-on-write); otherwise the
        child is queued and its prompt found in the prefix cache. An Output only if the child cannot run."""
        self._live[child.request_id] = child
        parent = self._live.get(parent_id)
        if parent is not None:  # the parent may have grown since fork() checked the size
            child.token_ids = list(parent.token_ids)
            child.num_prompt_tokens = len(child.token_ids)
            reply_start = parent.num_prompt_tokens
        else:
            reply_start = self._history[parent_id][1] if parent_id in self._history else child.num_prompt_tokens
        # Told in its first update: the parent's reply may have grown since the caller last saw it.
        child.inherited = self.detokenizer.decode(child.token_ids[reply_start:child.num_prompt_tokens])
        if parent is not None:
            try:
                self.check_fits(child.token_ids, child.params)
            except RequestError as exc:
                return self._finish(child, FinishReason.ERROR, str(exc))
        if parent is not None and parent.status is SeqStatus.RUNNING and \
                len(self.scheduler.running) < self.scheduler.max_seqs:
            self.scheduler.set_computed(child, parent.num_computed)
            self.pages.fork(parent, child)
            child.prefix_counted = True
            child.cached_tokens = parent.num_computed
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child)
        return None

    def cancel(self, request_id: str) -> Output | None:
        seq = self._live.get(request_id)
        return self._finish(seq, FinishReason.CANCELLED) if seq is not None else None

    def fail(self, seq: Sequence, error: str) -> Output:
        return self._finish(seq, FinishReason.ERROR, error)

    # ---- one step ----------------------------------------------------------------------------------------
    def run_step(self, model: ModelStep, lock: ContextManager | None = None) -> list[Output]:
        """schedule -> page copies -> forward -> sample -> postprocess, each phase's fault hook as it ends. A
        batch phase's exception propagates: the caller hands it to abort_step."""
        lock = contextlib.nullcontext() if lock is None else lock
        with lock:
            plan = self.schedule()
        began = time.perf_counter()
        model.copy_pages(plan.group_ops)  # even for a step that computes nothing: preemptions may plan swap-outs
        self.fault(Phase.COPY)
        tokens: list[Sampled | Exception] = []
        if plan.scheduled:
            logits = model.forward(plan)
            self.fault(Phase.FORWARD)
            tokens = model.sample(plan, logits)
            self.fault(Phase.SAMPLE)
        seconds = time.perf_counter() - began
        with lock:
            self.scheduler.observe(plan, seconds)
            return self.postprocess(plan, tokens, time.perf_counter())

    def schedule(self) -> StepPlan:
        self.phase = Phase.SCHEDULE
        plan = self.scheduler.schedule()
        self.fault(Phase.SCHEDULE)
        return plan

    def fault(self, phase: Phase, request_id: str | None = None) -> None:
        """Mark a phase reached (for abort_step) and give the fault hook its turn."""
        if request_id is None:
            self.phase = phase
        if self.fault_hook is not None:
            self.fault_hook(phase, request_id)

    def postprocess(self, plan: StepPlan, tokens: list[Sampled | int | Exception], now: float) -> list[Output]:
        """After the forward pass: count what each chunk computed, append the sampled tokens (a draft's kept
        prefix and the model's next), and stream, stop or finish each request. A fault here, or in sampling a
        row (its exception in place of its token), fails only the request it concerns."""
        self.phase = Phase.BOOKKEEPING
        self._outputs = out = []
        token_iter = (t if isinstance(t, (Sampled, Exception)) else Sampled(t) for t in tokens)
        for item in plan.scheduled:
            seq = item.seq
            rows = [next(token_iter) for _ in range(item.rows)]
            error = next((t for t in rows if isinstance(t, Exception)), None)
            if error is not None:
                out.append(self.fail(seq, f"{Phase.SAMPLE.value} failed: {type(error).__name__}: {error}"))
                continue
            try:
                output = self._advance(seq, item, rows, now)
            except Exception as exc:
                log.exception("bookkeeping failed for %s", seq.request_id)
                output = self.fail(seq, f"{type(exc).__name__}: {exc}")
            if output is not None:
                out.append(output)
        if plan.scheduled:
            self.steps += 1
        self.fault(Phase.BOOKKEEPING)  # the whole batch's
        self.pages.end_step()
        self._outputs = []
        return out

    def _verify(self, seq: Sequence, draft: tuple[int, ...], rows: list[Sampled]) -> list[Sampled]:
        """The rows kept: while the model's token equals the draft's (the sampler's rejection rule makes that
        the test for sampled rows too), then the model's own. The K/V of the rejected draft tokens are dropped:
        their pages go back to the pool."""
        accepted = 0
        while accepted < len(draft) and rows[accepted].token == draft[accepted]:
            accepted += 1
        self.scheduler.set_computed(seq, seq.num_computed - (len(draft) - accepted))
        self.pages.roll_back(seq)
        seq.drafted += len(draft)
        seq.accepted += accepted
        counters = self.pages.counters
        counters.drafted += len(draft)
        counters.accepted += accepted
        if self.scheduler.speculation is not None:
            self.scheduler.speculation.settle(seq, len(draft), accepted)
        return rows[:accepted + 1]

    def _advance(self, seq: Sequence, item: ScheduledSeq, rows: list[Sampled], now: float) -> Output | None:
        n = item.num_tokens
        if seq.num_computed < seq.num_prompt_tokens:
            seq.prefilled_tokens += min(n, seq.num_prompt_tokens - seq.num_computed)
        self.scheduler.set_computed(seq, seq.num_computed + n)
        if not rows:  # a prefill chunk short of the prompt's end
            self.fault(Phase.BOOKKEEPING, seq.request_id)
            return None
        if item.draft:
            rows = self._verify(seq, item.draft, rows)
        if seq.request_id in self._pending:
            self._release_siblings(seq)
        text, tokens, logprobs, reason, error = "", [], [], None, None
        for sampled in rows:  # stops apply per token: a stop inside a kept draft drops the rest
            token = sampled.token
            seq.token_ids.append(token)
            tokens.append(token)
            if sampled.logprob is not None:
                seq.sampled.append(sampled)
                logprobs.append(sampled)
            piece, stopped = self.detokenizer.step(seq)
            text += piece
            reason, error = self._finish_reason(seq, token, stopped), sampled.error
            if reason is not None or error is not None:
                break
        if item.draft:  # the kept tokens' full pages are published now, as a decode's are when scheduled
            self.pages.register_full_pages(seq, seq.num_computed)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self.fault(Phase.DETOKENIZE, seq.request_id)
        self.fault(Phase.BOOKKEEPING, seq.request_id)
        if error is not None:
            return self._finish(seq, FinishReason.ERROR, error, new_tokens=tokens, text=text)
        if reason is not None:
            return self._finish(seq, reason, new_tokens=tokens, text=text, logprobs=logprobs)
        return seq, seq.update(text, tokens, logprobs)

    def _finish_reason(self, seq: Sequence, token: int, stopped: bool) -> FinishReason | None:
        p = seq.params
        if stopped or (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens:
            return FinishReason.LENGTH
        if len(seq.token_ids) >= self.max_context:
            return FinishReason.CONTEXT_FULL
        return None

    def abort_step(self, exc: BaseException) -> list[Output]:
        """A step failed outside one request's phases: fail the requests it concerns (after handing over what
        its bookkeeping had already produced), then make the pool agree with the survivors."""
        error = f"{self.phase.value} failed: {type(exc).__name__}: {exc}"
        out, self._outputs = self._outputs, []
        damage = self.pages.abort_step(copies_ran=self.phase not in (Phase.SCHEDULE, Phase.COPY))
        queued = {id(s) for s in self.scheduler.all_seqs()}
        queued |= {id(s) for sibs in self._pending.values() for s in sibs}  # waiting on a parent, untouched
        concerned = [item.seq for item in self.scheduler.plan.scheduled]
        concerned += [s for s in self.scheduler.all_seqs() if any(d.touches(s) for d in damage)]
        concerned += [s for s in self._live.values() if id(s) not in queued]  # lost by a half-done plan
        for seq in dict.fromkeys(concerned):
            if seq.status is not SeqStatus.FINISHED:
                out.append(self.fail(seq, error))
        self.pages.repair(self.scheduler.all_seqs())
        return out

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                new_tokens: list[int] | None = None, text: str = "", logprobs: list[Sampled] | None = None) -> Output:
        """Release seq's pages at once and build its final update (text: what this step already decoded)."""
        if seq.request_id in self._pending:  # ended before its prompt was computed
            self._release_siblings(seq)
        rest, whole = self.detokenizer.finish(seq)
        text += rest
        seq.finish_reason = reason
        seq.error = error
        outcome = seq.outcome(whole)
        self.scheduler.finish(seq)
        if self._live.get(seq.request_id) is seq:
            del self._live[seq.request_id]
        self._history[seq.request_id] = (list(seq.token_ids), seq.num_prompt_tokens)
        if len(self._history) > HISTORY_LIMIT:
            self._history.pop(next(iter(self._history)))
        return seq, seq.update(text, new_tokens or (), logprobs or (), outcome)
