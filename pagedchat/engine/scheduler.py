"""Who runs in each engine step, and with how many tokens.

Every step has a token budget. Running sequences go first, oldest first: a decode costs one token, and a
prompt being prefilled takes what the budget leaves after every running decode has its token (chunked
prefill), so a long paste never stalls the other chats. Then swapped-out and waiting sequences join. The
budget is max_tokens_per_step, or with a StepTimer what takes about its seconds, whichever is fewer.

A waiting sequence whose prompt continues into a page that this step's forward pass writes (a shared system
prompt's last page, while its first chat computes it) waits a step: the page can be copied only once written,
and computing the tokens it holds instead would do that work once for every chat that came with the first.

The batch is shared per request: a request's n replies count as one request running n sequences (its share).
- Joining: the queued sequence whose request runs the fewest goes first (a swapped one before a waiting one
  among equals, then in queue order), so a new request never waits behind another's n replies.
- Preemption: when a running sequence needs a page and none is left, the victim is the newest sequence of the
  request running the most; among requests running as many, the newest (first come, first served).
- When the batch is full, a queued request running at least two fewer sequences than the largest takes a slot
  from it: the largest's newest is preempted.
A preempted sequence is swapped to the CPU tier, or dropped for recompute when the tier is full.

Speculative decoding (engine/ngram.py): a decoding sequence whose own text proposes a draft computes its next
token and the draft's k in one chunk, each position sampled; the core keeps the draft's prefix the model agrees
with and rolls back the pages of the rest. Drafts come out of the prefill budget, and never preempt: a draft
is dropped for that step unless the pool keeps two free pages for every running sequence beside it.

The scheduler is the one writer of a sequence's status (as nano-vllm's): it moves a sequence between its
queues and sets the status with the move, the end included (finish). Everything else only reads it. Likewise
num_computed moves in set_computed alone: the scheduler's admissions and preemptions call it, and the core's
steps, verified drafts and forks (tests/engine/test_scheduler.py holds both rules).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from pagedchat.engine.admission import Admission
from pagedchat.engine.ngram import Speculation
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.pages import CopyPlan
from pagedchat.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computed this step, starting at seq.num_computed
    samples: bool    # the chunk reaches the sequence's end, so its last logits pick a token
    draft: tuple[int, ...] = ()  # proposed tokens after the sequence's last, computed in this chunk's tail

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the sequence's from num_computed, then the draft."""
        start = self.seq.num_computed
        return self.seq.token_ids[start:start + self.num_tokens - len(self.draft)] + list(self.draft)

    @property
    def rows(self) -> int:
        """Positions whose logits are sampled: the last, and each draft token's before it."""
        return 1 + len(self.draft) if self.samples else 0


STEP_SECONDS = 0.5  # Engine's default: see StepTimer


def check_step_seconds(seconds: float) -> None:
    """Raise ValueError unless seconds is a step time a StepTimer can size by (config.toml's check too)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"step_seconds must be a number of seconds above 0, not {seconds!r}")


@dataclass
class StepTimer:
    """Sizes a step to take about `seconds`, so that a long paste holds every other chat's next token back by
    about that long, whatever the model's size and the machine's speed. The seconds a token costs are learnt
    from the steps that computed at least `least` tokens (smaller ones mostly read the weights), each step's
    figure averaged with the ones before, so the budget follows a machine that gets busy or a context that
    grows."""

    seconds: float
    least: int = 64
    per_token: float | None = None  # None until a step of `least` tokens has run

    def __post_init__(self):
        check_step_seconds(self.seconds)

    def tokens(self, most: int) -> int:
        """This step's budget: at most `most`, at least `least`. The least until a step has been measured: the
        first prompt of a large model on a slow machine would otherwise hold every stream back for seconds."""
        least = min(self.least, most)
        if self.per_token is None:
            return least
        return max(least, min(most, int(self.seconds / self.per_token)))

    def observe(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` tokens in `seconds`."""
        if tokens < self.least or seconds <= 0:
            return
        cost = seconds / tokens
        self.per_token = cost if self.per_token is None else (self.per_token + cost) / 2


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
    def __init__(self, pages: PageGroups, max_tokens_per_step: int = 512, max_seqs: int = 64,
                 speculation: Speculation | None = None, timer: StepTimer | None = None):
        self.pages = pages
        self.speculation = speculation
        self.max_tokens_per_step = max(max_tokens_per_step, max_seqs)
        self.timer = timer
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
        self.pages.free_seq(seq)
        if self.speculation is not None:
            self.speculation.forget(seq)
        seq.status = SeqStatus.FINISHED

    def set_computed(self, seq: Sequence, num_tokens: int) -> None:
        """seq's first num_tokens tokens have their K/V in the cache."""
        seq.num_computed = num_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def all_seqs(self) -> list[Sequence]:
        return [*self.running, *self.swapped, *self.waiting]

    def step_tokens(self) -> int:
        """This step's token budget (module docstring)."""
        most = self.max_tokens_per_step
        return most if self.timer is None else self.timer.tokens(most)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """The plan's model work took `seconds`: what the timer sizes the next steps by."""
        if self.timer is not None:
            self.timer.observe(plan.num_tokens, seconds)

    def schedule(self) -> StepPlan:
        self.plan = plan = StepPlan()
        self._share_slots()
        budget = self.step_tokens()
        decodes = sum(1 for s in self.running if s.num_uncomputed == 1)
        prefill_budget = budget - decodes
        drafting = self.speculation is not None and self.speculation.active(len(self.running))
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for one before it
            decode = seq.num_uncomputed == 1
            n = 1 if decode else min(seq.num_uncomputed, prefill_budget)
            if n <= 0 or not self._make_room(seq, n):
                continue
            draft = self._draft(seq, prefill_budget) if decode and drafting else ()
            # A prefill chunk, even of one token, and a draft come out of the prefill budget.
            prefill_budget -= len(draft) if decode else n
            self._schedule(plan, seq, n + len(draft), draft)
        self._join(plan, budget - plan.num_tokens)
        plan.group_ops = self.pages.take_ops()
        return plan

    def _schedule(self, plan: StepPlan, seq: Sequence, n: int, draft: tuple[int, ...] = ()) -> None:
        """Only the sequence's own tokens are hashed: a draft's pages are published once its tokens are kept."""
        self.pages.register_full_pages(seq, seq.num_computed + n - len(draft))
        plan.scheduled.append(ScheduledSeq(seq, n, seq.num_computed + n - len(draft) == len(seq.token_ids), draft))

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """seq's draft for this step, at most budget tokens, with pages for it taken (copy-on-write included),
        or () where it has none or the pool has no free page for it."""
        spec = self.speculation
        draft = spec.draft(seq, min(budget, spec.room(seq)))
        # Two pages kept free for each running sequence (a new page and a copy-on-write): a draft never takes
        # the pages that another's own token needs, which would preempt it.
        if not draft or not self.pages.can_write(seq, 1 + len(draft), 2 * len(self.running)):
            return ()
        self.pages.prepare_write(seq, 1 + len(draft))
        return tuple(draft)

    def _shares(self) -> Counter[str]:
        """How many sequences each request runs."""
        return Counter(s.request for s in self.running)

    def _victim(self) -> Sequence | None:
        """The running sequence to preempt, of those not yet in this step's plan (module docstring)."""
        shares, planned = self._shares(), {item.seq for item in self.plan.scheduled}
        candidates = [s for s in self.running if s not in planned]
        return max(candidates, key=lambda s: (shares[s.request], s.arrival), default=None)

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Pages for seq's next n tokens, preempting others as needed. False if seq itself went."""
        while not self.pages.prepare_write(seq, n):
            victim = self._victim()  # never None: seq itself is a candidate
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _next_in(self, held: set[Sequence] = frozenset()) -> Sequence | None:
        """The queued sequence to join next, of those not held: its request runs the fewest; swapped first, then
        queue order."""
        shares = self._shares()
        queued = [s for s in (*self.swapped, *self.waiting) if s not in held]
        return min(queued, key=lambda s: shares[s.request], default=None)  # min keeps the first of equals

    def _share_slots(self) -> None:
        """A full batch gives a slot to a queued request running two or more fewer sequences than the largest."""
        while len(self.running) >= self.max_seqs and (seq := self._next_in()) is not None:
            victim, shares = self._victim(), self._shares()
            if victim is None or shares[victim.request] < shares[seq.request] + 2:
                return
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.pages.swap_out(seq):
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.pages.free_seq(seq)  # its pages and hashes, in every group
            self.pages.counters.recomputes += 1
            self.set_computed(seq, 0)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def _join(self, plan: StepPlan, budget: int) -> None:
        """Swapped and waiting sequences join while the budget, the batch and the pool allow; the first that
        does not fit stops the others (a smaller one behind it would otherwise keep a long prompt out). One that
        waits for a page this step writes lets the others by."""
        held: set[Sequence] = set()
        while budget > 0 and len(self.running) < self.max_seqs and (seq := self._next_in(held)) is not None:
            if seq.status is SeqStatus.SWAPPED:
                n = min(seq.num_uncomputed, budget)
                if not self.pages.swap_in(seq, n):
                    return
                self.swapped.remove(seq)
            else:
                admission = self._admit(seq, budget)
                if admission.waits:
                    held.add(seq)
                    continue
                if admission.num_tokens == 0:
                    return
                n = admission.num_tokens
                self.waiting.remove(seq)
            self._insert_running(seq)
            self._schedule(plan, seq, n)
            budget -= n

    def _admit(self, seq: Sequence, budget: int) -> Admission:
        """Admit a waiting seq with its cached prefix: how many tokens it computes this step (0 if it has no room
        or waits)."""
        admission = self.pages.admit(seq, budget)
        if admission.num_tokens:
            self.set_computed(seq, admission.start)
            if not seq.prefix_counted:  # its first admission: what the prefix cache served it
                seq.prefix_counted = True
                seq.cached_tokens = admission.start
        return admission

    def _insert_running(self, seq: Sequence) -> None:
        """Keep running in arrival order: the oldest are scheduled first."""
        seq.status = SeqStatus.RUNNING
        pos = len(self.running)
        while pos > 0 and self.running[pos - 1].arrival > seq.arrival:
            pos -= 1
        self.running.insert(pos, seq)
