"""A fake model over the real engine core, for tests without torch work.

PageContents records, slot by slot, which token history each K/V slot was computed from. Every read of the
cache is checked against the history it should hold, so a page handed out while still needed, a copy planned
in the wrong place or a stale hash shows up as a wrong "K/V", exactly as it would as a wrong token with a
real model. FakeEngine runs the real EngineCore's step (EngineCore.run_step: scheduling, bookkeeping, stops,
forks, fault recovery) over FakeModel, whose forward pass is PageContents.
"""

from __future__ import annotations

from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.core import EngineCore, FaultHook, Output, Phase
from pagedchat.engine.ngram import Speculation
from pagedchat.engine.detokenizer import Detokenizer
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.records import NULL_PAGE, Outcome
from pagedchat.engine.sequence import SeqStatus, Sequence
from pagedchat.errors import RequestError


def make_seq(tokens, rid="s", max_tokens=16, group="") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    group=group)


def admit_waiting(pages: BlockManager | PageGroups, seq: Sequence, budget: int = 10**6) -> int:
    """What the scheduler does to admit a waiting seq (Scheduler._admit), for the tests of the pages alone: the
    tokens it computes this step, 0 where it has no room."""
    admission = pages.admit(seq, budget)
    if admission.num_tokens:
        seq.num_computed = admission.start
        if not seq.prefix_counted:
            seq.prefix_counted, seq.cached_tokens = True, admission.start
    return admission.num_tokens


def toks(n: int, salt: int = 0) -> list[int]:
    return [(salt * 1000 + i) % 997 + 1 for i in range(n)]


class PageContents:
    """What each GPU and CPU slot holds, in one layer group's pool: the key of the token history its K/V was
    computed from. A window group's attention reads only the positions its window reaches."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.gpu: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], int] = {}

    @staticmethod
    def keys(tokens: list[int]) -> list[int]:
        out, k = [], 0
        for t in tokens:
            k = hash((k, t))
            out.append(k)
        return out

    def apply(self, ops) -> None:
        """In the model runner's order: swap-outs, swap-ins, copy-on-write."""
        bs = self.bm.block_size
        for g, c in ops.swap_out:
            for s in range(bs):
                self.cpu[c, s] = self.gpu.get((g, s))
        for c, g in ops.swap_in:
            for s in range(bs):
                self.gpu[g, s] = self.cpu.get((c, s))
        for src, dst in ops.cow:
            for s in range(bs):
                self.gpu[dst, s] = self.gpu.get((src, s))

    def write(self, seq: Sequence, start: int, end: int, history: list[int] | None = None) -> None:
        """history: the tokens up to end, where they run past seq's own (a draft's)."""
        bs = self.bm.block_size
        keys = self.keys((history or seq.token_ids)[:end])
        table = seq.table(self.bm.group).block_table
        for pos in range(start, end):
            self.gpu[table[pos // bs], pos % bs] = keys[pos]

    def check(self, seq: Sequence, end: int, start: int = 0, history: list[int] | None = None) -> None:
        """Attention of positions [start, end) of seq reads exactly seq's history: all of it before end, or in
        a window group, what the first query's window reaches."""
        bs = self.bm.block_size
        keys = self.keys((history or seq.token_ids)[:end])
        table = seq.table(self.bm.group).block_table
        window = self.bm.window
        for pos in range(0 if window is None else max(0, start - window + 1), end):
            got = self.gpu.get((table[pos // bs], pos % bs))
            assert got == keys[pos], f"{seq.request_id}: position {pos} holds the K/V of another history"

    def check_cached(self, known: dict[int, list[int]]) -> None:
        """Every advertised page, on the GPU or the CPU tier, holds the content its hash names."""
        bs = self.bm.block_size
        for h, page in self.bm.prefix.cached.items():
            if h in known:
                assert [self.gpu.get((page, s)) for s in range(bs)] == known[h], "stale cached GPU page"
        for h, page in self.bm.cpu.cached_pages().items():
            if h in known:
                assert [self.cpu.get((page, s)) for s in range(bs)] == known[h], "stale cached CPU page"

    # single-sequence helpers for the bookkeeping tests above
    def prefill(self, seq: Sequence) -> None:
        n = admit_waiting(self.bm, seq)
        assert n
        self.bm.register_full_pages(seq, seq.num_computed + n)
        self.apply(self.bm.take_ops())
        self.write(seq, seq.num_computed, seq.num_computed + n)
        seq.num_computed += n
        self.check(seq, seq.num_computed)
        self.bm.end_step()


def next_token(history_key: int) -> int:
    return history_key % 500 + 1


def isolated(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    key = PageContents.keys(tokens)[-1]
    for _ in range(max_tokens):
        t = next_token(key)
        out.append(t)
        key = hash((key, t))
    return out


class DigitTokenizer:
    """Token ids as text: enough for the real Detokenizer."""

    chat_template = None

    @staticmethod
    def decode(ids, skip_special_tokens=True) -> str:
        return "".join(f" {t}" for t in ids)


class FakeModel:
    """The model's part of a step (core.ModelStep) over each layer group's PageContents, checking every plan it is
    given."""

    def __init__(self, core: EngineCore, sims: list[PageContents]) -> None:
        self.core = core
        self.sims = sims

    def copy_pages(self, group_ops) -> None:
        plan = self.core.scheduler.plan
        assert plan.scheduled or not plan.ops, "copies planned for a step that runs no forward pass"
        # over budget only when every scheduled sequence decodes one token (forks may outnumber the budget)
        budget = self.core.scheduler.max_tokens_per_step
        assert plan.num_tokens <= budget or all(i.num_tokens == 1 for i in plan.scheduled)
        for sim, ops in zip(self.sims, group_ops):
            sim.apply(ops)

    def forward(self, plan) -> None:
        # A forward pass can fail before it writes any K/V (the worst case for recovery): the hook's turn here
        # too, as well as after the pass.
        self.core.fault(Phase.FORWARD)
        for item in plan.scheduled:  # every layer writes its K/V before attention reads them
            s = item.seq
            for sim in self.sims:
                sim.write(s, s.num_computed, s.num_computed + item.num_tokens, history(item))
        for sim in self.sims:
            bs, group = sim.bm.block_size, sim.bm.group
            pages_written = [p for item in plan.scheduled
                             for p in {item.seq.table(group).block_table[pos // bs]
                                       for pos in range(item.seq.num_computed,
                                                        item.seq.num_computed + item.num_tokens)}]
            assert len(pages_written) == len(set(pages_written)), "two sequences wrote into one page in one step"
            assert NULL_PAGE not in pages_written, "a write into a released block"
        for item in plan.scheduled:
            s = item.seq
            for sim in self.sims:
                sim.check(s, s.num_computed + item.num_tokens, s.num_computed, history(item))

    def sample(self, plan, logits) -> list[int]:
        """The next token after each sampled position: a draft's chunk samples each of its last 1 + k."""
        out = []
        for item in plan.scheduled:
            keys = self.sims[0].keys(history(item))
            out += [next_token(key) for key in keys[len(keys) - item.rows:]]
        return out


def history(item) -> list[int]:
    """The tokens a scheduled chunk's positions see: the sequence's computed ones, then the chunk's."""
    return item.seq.token_ids[:item.seq.num_computed] + item.token_ids


class FakeEngine:
    """The engine's step (EngineCore.run_step, as Engine.step runs it) with FakeModel as the model."""

    def __init__(self, num_pages: int, cpu_pages: int, budget: int, max_seqs: int = 8, block_size: int = 4,
                 fault_hook: FaultHook | None = None, max_context: int = 10**6, window: int | None = None,
                 window_pages: int | None = None, speculation: Speculation | None = None):
        """window: a second layer group of that sliding window beside the global one (window_pages pages, as
        many as the global group's by default), as a Gemma-3-shaped model has."""
        self.bm = BlockManager(num_pages, block_size, cpu_pages)
        self.managers = [self.bm]
        if window is not None:
            self.managers.append(BlockManager(window_pages or num_pages, block_size, cpu_pages, group=1,
                                              window=window))
        self.pages = PageGroups(tuple(self.managers), budget)
        self.sched = Scheduler(self.pages, budget, max_seqs, speculation)
        self.sched.max_tokens_per_step = budget  # allow budgets below max_seqs here
        self.core = EngineCore(self.pages, self.sched, Detokenizer(DigitTokenizer()), frozenset(), max_context,
                               fault_hook)
        self.sims = [PageContents(m) for m in self.managers]
        self.sim = self.sims[0]
        self.model = FakeModel(self.core, self.sims)
        self.ended: dict[str, Outcome] = {}  # every request that ended, once each
        self.known: dict[int, list[int]] = {}  # page hash -> the K/V keys its content must hold
        self.done: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (prompt, output), finished by length
        self.n = 0

    def live(self, rid: str) -> bool:
        return self.core.sequence(rid) is not None

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n - 1}"

    def add(self, prompt: list[int], max_tokens: int, n: int = 1) -> str | None:
        """A request; n > 1: n replies to the prompt (ids rid, rid-1, ...), as the engine's submit_many makes."""
        rid = self._new_id()
        seq, *siblings = [make_seq(prompt, rid if i == 0 else f"{rid}-{i}", max_tokens, group=rid)
                          for i in range(n)]
        try:
            self.core.check_fits(seq.token_ids, seq.params)
        except RequestError:
            return None
        self.core.add_group(seq, siblings)
        return seq.request_id

    def fork(self, parent_id: str, max_tokens: int) -> str | None:
        tokens = self.core.tokens_of(parent_id)
        if tokens is None:
            return None
        child = make_seq(tokens, self._new_id(), max_tokens)
        try:
            self.core.check_fits(tokens, child.params)
        except RequestError:
            return None
        self._collect([o for o in [self.core.fork(child, parent_id)] if o is not None])
        return child.request_id

    def cancel(self, rid: str) -> None:
        self._collect([o for o in [self.core.cancel(rid)] if o is not None])

    def step(self) -> list[Output]:
        try:
            out = self.core.run_step(self.model)
        except Exception as exc:  # what Engine.step does with a fault in a batch phase
            out = self.core.abort_step(exc)
        self._collect(out)
        self.check()
        return out

    def _collect(self, out: list[Output]) -> None:
        for seq, update in out:
            if not update.finished:
                continue
            assert seq.request_id not in self.ended, f"{seq.request_id} ended twice"
            assert not self.live(seq.request_id)
            assert not any(t.block_table or t.cpu_table for t in seq.tables)
            self._learn(seq)
            outcome = update.outcome
            self.ended[seq.request_id] = outcome
            if outcome.finish_reason == "length":
                self.done[seq.request_id] = (outcome.prompt_token_ids, outcome.token_ids)

    def check(self) -> None:
        seqs = self.sched.all_seqs()
        self.pages.check_invariants(seqs)
        for s in seqs:
            self._learn(s)
        for m, sim in zip(self.managers, self.sims):
            self._check_group(m, sim, seqs)

    def _check_group(self, m: BlockManager, sim: PageContents, seqs: list[Sequence]) -> None:
        bs = m.block_size
        for s in seqs:
            table = s.table(m.group)
            if s.status is SeqStatus.RUNNING:
                assert len(table.block_table) == m.pages_for(s.num_computed) and not table.cpu_table
            elif s.status is SeqStatus.SWAPPED:
                assert not table.block_table and len(table.cpu_table) == m.pages_for(s.num_computed)
            else:
                assert not table.block_table and not table.cpu_table and s.num_computed == 0
            for entries in (table.block_table, table.cpu_table):  # released blocks: a leading run, window only
                released = entries.count(NULL_PAGE)
                assert entries[:released] == [NULL_PAGE] * released and (released == 0 or m.window is not None)
                if m.window is not None:  # its window's pages and a chunk's (and, pinned, a copy source)
                    assert len(entries) - released < m.most_pages(self.sched.max_tokens_per_step)
        sim.check_cached(self.known)
        for s in seqs:  # swapped pages still hold their sequence's history
            keys = sim.keys(s.token_ids)
            cpu_table = s.table(m.group).cpu_table
            for pos in range(s.num_computed if cpu_table else 0):
                if cpu_table[pos // bs] != NULL_PAGE:
                    assert sim.cpu.get((cpu_table[pos // bs], pos % bs)) == keys[pos]

    def _learn(self, seq: Sequence) -> None:
        """Remember what each of seq's hashed pages holds, so a stale page is caught even after seq ended."""
        bs = self.bm.block_size
        keys = self.sim.keys(seq.token_ids)
        for i, h in enumerate(seq.table(0).page_hashes):
            self.known[h] = keys[i * bs:(i + 1) * bs]

    def drain(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.core.has_work():
                return
            self.step()
        raise AssertionError("no progress: the scheduler looks deadlocked")
