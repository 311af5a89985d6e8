"""Who runs in each engine step, and with how many tokens.

Every step has a token budget. Running sequences go first, oldest first: a decode costs one token, and a
prompt being prefilled takes what the budget leaves after every running decode has its token (chunked
prefill), so a long paste never stalls the other chats. Then swapped-out sequences come back, then waiting
ones are admitted. When a running sequence needs a page and none is left, the newest running sequence is
preempted: swapped to the CPU tier, or dropped for recompute when the tier is full.

The scheduler is the one writer of a sequence's status (as nano-vllm's): it moves a sequence between its
queues and sets the status with the move, the end included (finish). Everything else only reads it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.pages import CopyPlan
from pagedchat.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computed this step, starting at seq.num_computed
    samples: bool    # the chunk reaches the sequence's end, so its last logits pick a token


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    group_ops: tuple[CopyPlan, ...] = ()  # page copies, one plan per layer group (see PageGroups)

    @property
    def ops(self) -> CopyPlan:
        """The first layer group's copies: all of them, in a model without windows."""
        return self.group_ops[0] if self.group_ops else CopyPlan()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: PageGroups, max_tokens_per_step: int = 512, max_seqs: int = 64):
        self.block_manager = block_manager
        self.max_tokens_per_step = max(max_tokens_per_step, max_seqs)
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.plan = StepPlan()             # the step being planned or run: after a fault, the requests it concerns

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence: it already maps its parent's pages."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take seq out of every queue and release its pages (it ended, was cancelled or failed)."""
        for queue in (self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def all_seqs(self) -> list[Sequence]:
        return [*self.running, *self.swapped, *self.waiting]

    def schedule(self) -> StepPlan:
        self.plan = plan = StepPlan()
        decodes = sum(1 for s in self.running if s.num_uncomputed == 1)
        prefill_budget = self.max_tokens_per_step - decodes
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            decode = seq.num_uncomputed == 1
            n = 1 if decode else min(seq.num_uncomputed, prefill_budget)
            if n <= 0:
                i += 1
                continue
            if not self._make_room(seq, n):
                continue  # seq itself was preempted; the list shrank under i
            if not decode:  # a prefill chunk, even of one token, comes out of the prefill budget
                prefill_budget -= n
            self._schedule(plan, seq, n)
            i += 1
        budget = self.max_tokens_per_step - plan.num_tokens
        budget = self._resume_swapped(plan, budget)
        self._admit_waiting(plan, budget)
        plan.group_ops = self.block_manager.take_ops()
        return plan

    def _schedule(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        self.block_manager.register_full_pages(seq, seq.num_computed + n)
        plan.scheduled.append(ScheduledSeq(seq, n, seq.num_computed + n == len(seq.token_ids)))

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Pages for seq's next n tokens, preempting newer sequences as needed. False if seq itself went."""
        while not self.block_manager.prepare_write(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.block_manager.swap_out(seq):
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.block_manager.free_seq(seq)
            self.block_manager.counters.recomputes += 1
            seq.num_computed = 0
            seq.page_hashes = []
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def _resume_swapped(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and len(self.running) < self.max_seqs and budget > 0:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed, budget)
            if not self.block_manager.swap_in(seq, n):
                break
            self.swapped.popleft()
            self._insert_running(seq)
            self._schedule(plan, seq, n)
            budget -= n
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        if self.swapped:
            return  # swapped sequences come back first, so a stream of new requests cannot starve them
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            n = self.block_manager.admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self._insert_running(seq)
            self._schedule(plan, seq, n)
            budget -= n

    def _insert_running(self, seq: Sequence) -> None:
        """Keep running in arrival order, so preemption always picks the newest."""
        seq.status = SeqStatus.RUNNING
        pos = len(self.running)
        while pos > 0 and self.running[pos - 1].arrival > seq.arrival:
            pos -= 1
        self.running.insert(pos, seq)
