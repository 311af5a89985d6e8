"""The engine core (scheduling, bookkeeping, stops, forks, fault recovery) over a fake model.

FakeEngine (fake_engine.py) runs the real EngineCore with a forward pass that records which token history each
K/V slot holds, so every read of the cache is checked, after every step, faults included.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from fake_engine import FakeEngine, isolated, toks
from pagedchat.engine.core import Phase
from pagedchat.engine.records import FinishReason

BATCH = (Phase.SCHEDULE, Phase.COPY, Phase.FORWARD, Phase.SAMPLE)


class InjectedFault(RuntimeError):
    pass


class Faults:
    """A fault hook: raises once in the armed phase (for a per-request phase, in the first request, or the
    one named, to reach it), and remembers where it fired."""

    def __init__(self):
        self.armed: tuple[Phase, str | None] | None = None
        self.fired: tuple[Phase, str | None] | None = None
        self.when = lambda: True

    def arm(self, phase: Phase, request_id: str | None = None, when=lambda: True) -> None:
        self.armed, self.fired, self.when = (phase, request_id), None, when

    def __call__(self, phase: Phase, request_id: str | None) -> None:
        if self.armed is None or self.armed[0] is not phase or not self.when():
            return
        if self.armed[1] is not None and self.armed[1] != request_id:
            return
        self.armed, self.fired = None, (phase, request_id)
        raise InjectedFault(f"injected into {phase.value}")


def errors(eng: FakeEngine) -> set[str]:
    return {rid for rid, c in eng.ended.items() if c.finish_reason == "error"}


def test_one_token_prefill_chunks_count_against_the_step_budget():
    """A request forked twice while its prompt is being prefilled: three prefills compete for a budget of 3.
    A chunk of one prompt token is still prefill, not a decode, so the three never get more than 3 tokens."""
    eng = FakeEngine(num_pages=40, cpu_pages=0, budget=3, max_seqs=3)
    eng.add(toks(5), 3)
    eng.step()  # 3 of 5 prompt tokens
    eng.fork("r0", 3)
    eng.fork("r0", 3)
    plan = eng.sched.schedule()
    assert [(item.seq.request_id, item.num_tokens) for item in plan.scheduled] == [("r0", 2), ("r1", 1)]
    assert plan.num_tokens == 3


def test_fake_scheduler_preemption_by_swap_and_recompute():
    for cpu_pages in (0, 3, 40):
        eng = FakeEngine(num_pages=10, cpu_pages=cpu_pages, budget=12)
        prompts = [toks(7 + 3 * i, i % 3) for i in range(6)]  # shared prefixes between some of them
        for p in prompts:
            eng.add(p, 9)
        eng.drain()
        assert len(eng.done) == 6
        for prompt, out in eng.done.values():
            assert out == isolated(prompt, len(out))
        c = eng.bm.counters
        assert c.swap_outs + c.recomputes > 0
        if cpu_pages == 0:
            assert c.swap_outs == 0 and c.recomputes > 0
        if cpu_pages == 40:
            assert c.swap_outs > 0
        eng.bm.check_invariants([])
        assert eng.bm.pool.num_available() == 10


def test_fake_scheduler_swapped_sequence_resumes_on_a_page_boundary():
    """Three chats share a prompt; the newest is swapped out with a full last page and resumed at once."""
    eng = FakeEngine(num_pages=6, cpu_pages=2, budget=3)
    for max_tokens in (7, 6, 4):
        eng.add(toks(5) + [9], max_tokens)
    eng.drain()
    assert eng.bm.counters.swap_outs and eng.bm.counters.swap_ins
    for prompt, out in eng.done.values():
        assert out == isolated(prompt, len(out))


# ---- faults --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", [Phase.DETOKENIZE, Phase.BOOKKEEPING])
def test_a_fault_in_one_requests_phase_fails_that_request_only(phase):
    faults = Faults()
    eng = FakeEngine(num_pages=20, cpu_pages=4, budget=16, fault_hook=faults)
    a, b = eng.add(toks(9), 8), eng.add(toks(9, 1), 8)
    eng.step()
    eng.step()
    faults.arm(phase, a)
    eng.step()
    assert faults.fired == (phase, a) and errors(eng) == {a}
    assert f"injected into {phase.value}" in eng.ended[a].error
    eng.drain()
    assert eng.done[b] == (toks(9, 1), isolated(toks(9, 1), 8))
    assert eng.bm.pool.num_available() == eng.bm.num_pages


@pytest.mark.parametrize("phase", BATCH)
def test_a_fault_in_a_batch_phase_fails_that_steps_requests_and_no_other(phase):
    """r0 runs, r1 waits (one sequence at a time): a fault in any phase of r0's step fails r0 only, with the
    phase and the error in its message; r1 then runs as if nothing had happened."""
    faults = Faults()
    eng = FakeEngine(num_pages=20, cpu_pages=4, budget=16, max_seqs=1, fault_hook=faults)
    a, b = eng.add(toks(9), 8), eng.add(toks(9, 1), 8)
    eng.step()
    faults.arm(phase)
    eng.step()
    assert faults.fired == (phase, None) and errors(eng) == {a}
    assert eng.ended[a].error == f"{phase.value} failed: InjectedFault: injected into {phase.value}"
    eng.drain()
    assert eng.done == {b: (toks(9, 1), isolated(toks(9, 1), 8))}
    assert eng.bm.pool.num_available() == eng.bm.num_pages


def test_a_planning_fault_fails_the_sequence_its_uncopied_swap_out_would_have_saved():
    """The step that swaps a sequence out fails before its copies run: the swapped sequence's CPU pages
    never received its K/V, so it fails too, and no CPU page is advertised with content it does not hold."""
    faults = Faults()
    eng = FakeEngine(num_pages=6, cpu_pages=8, budget=8, fault_hook=faults)
    ids = [eng.add(toks(6, salt), 12) for salt in range(3)]
    faults.arm(Phase.SCHEDULE, when=lambda: bool(eng.sched.plan.ops.swap_out))
    eng.drain()
    assert faults.fired, "no step swapped a sequence out"
    swapped = [s for s in eng.sched.all_seqs() if s.table(0).cpu_table]
    assert not swapped and errors(eng) and set(eng.ended) == set(ids)
    for rid in set(ids) - errors(eng):
        prompt, out = eng.done[rid]
        assert out == isolated(prompt, 12)
    assert eng.bm.pool.num_available() == eng.bm.num_pages


def test_a_planning_fault_forgets_the_offloads_it_planned():
    """A's cached pages are evicted to the CPU tier in a step that fails before its copies run: the CPU tier
    must not advertise them, so A's prompt coming back is recomputed rather than read from empty CPU pages."""
    faults = Faults()
    eng = FakeEngine(num_pages=4, cpu_pages=8, budget=16, fault_hook=faults)
    a = eng.add(toks(9), 1)
    eng.drain()
    assert eng.bm.cpu.num_cached() == 0 and len(eng.bm.pool.evictable) == 2
    faults.arm(Phase.SCHEDULE, when=lambda: eng.bm.counters.offloads > 0)
    b = eng.add(toks(13, 1), 3)
    eng.step()
    assert faults.fired and errors(eng) == {b}
    assert eng.bm.cpu.num_cached() == 0, "offloads whose copies never ran are still advertised"
    again = eng.add(toks(9) + [5], 2)
    eng.drain()
    assert eng.ended[again].cached_tokens == 0 and eng.done[again] == (toks(9) + [5], isolated(toks(9) + [5], 2))
    assert eng.ended[a].finish_reason == "length"


def test_a_reply_that_fills_the_context_ends_as_context_full():
    eng = FakeEngine(num_pages=20, cpu_pages=0, budget=16, max_context=12)
    full, short = eng.add(toks(8), 10), eng.add(toks(5, 1), 3)
    eng.drain()
    assert eng.ended[full].finish_reason == "context_full" and len(eng.ended[full].token_ids) == 4
    assert eng.ended[full].finish_reason is FinishReason.CONTEXT_FULL
    assert eng.ended[short].finish_reason == "length"


OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 20), st.integers(1, 10)),
    st.tuples(st.just("step"), st.integers(0, 4)),
    st.tuples(st.just("fork"), st.integers(0, 30), st.integers(1, 10)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("fault"), st.sampled_from(list(Phase))),
)


@settings(max_examples=300 * int(os.environ.get("PAGEDCHAT_FUZZ", "1")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=8, max_size=40), num_pages=st.integers(6, 12),
       cpu_pages=st.sampled_from([0, 2, 6, 30]), budget=st.integers(3, 16))
# A request whose cached match ends inside a page, in a pool with no page to spare for the partial page's copy:
# it waited forever until admission learned to go without the copy.
@example(ops=[("add", 0, 1, 10), ("finish", 0), ("add", 1, 1, 1), ("fork", 0, 1), ("fork", 0, 5), ("add", 0, 3, 4),
              ("step", 1), ("fork", 1, 2), ("fork", 3, 1)], num_pages=6, cpu_pages=0, budget=16)
def test_fake_scheduler_random_operations(ops, num_pages, cpu_pages, budget):
    """Requests come and go, fork and fail; after every step (FakeEngine.step checks) every ref count equals
    the block tables mapping the page, no page is free and mapped, and every advertised page holds the
    content its hash names. Every request ends exactly once, and every one that ran to its length has the
    tokens it would have had alone."""
    run_random_operations(ops, FakeEngine(num_pages=num_pages, cpu_pages=cpu_pages, budget=budget,
                                          fault_hook=Faults()), cpu_pages)


@settings(max_examples=200 * int(os.environ.get("PAGEDCHAT_FUZZ", "1")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=8, max_size=40), num_pages=st.integers(6, 12), window_pages=st.integers(5, 12),
       window=st.sampled_from([1, 3, 6, 9]), cpu_pages=st.sampled_from([0, 2, 6, 30]), budget=st.integers(3, 16))
def test_fake_scheduler_random_operations_with_a_window_group(ops, num_pages, window_pages, window, cpu_pages,
                                                                budget):
    """The same, with a sliding-window layer group beside the global one (Gemma 3's shape): besides the checks
    above in both groups, each window group's attention finds its window's history in its own pages, its
    released blocks are a leading run, and it holds no more than its window and a chunk."""
    # At the least what one chat maps at once (BlockManager.most_pages), as the engine's sizing gives a window group.
    window_pages = max(window_pages, -(-(window + budget) // 4) + 2)
    eng = FakeEngine(num_pages=num_pages, cpu_pages=cpu_pages, budget=budget, fault_hook=Faults(), window=window,
                     window_pages=window_pages)
    run_random_operations(ops, eng, cpu_pages)
    if eng.managers[1].counters.window_released:
        event("window released")


def run_random_operations(ops, eng: FakeEngine, cpu_pages: int) -> None:
    faults = eng.core.fault_hook
    bases = [toks(20, salt) for salt in range(4)]
    added = []

    def pick(i):
        return f"r{i % max(eng.n, 1)}"

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, base, extra, max_tokens = op
            added.append(eng.add(bases[base][:4 + extra % 9] + toks(extra % 5, 10 + extra), max_tokens))
        elif kind == "step":
            for _ in range(op[1]):
                eng.step()
        elif kind == "fork":
            added.append(eng.fork(pick(op[1]), op[2]))
        elif kind == "cancel":
            eng.cancel(pick(op[1]))
        elif kind == "finish":
            for _ in range(1000):
                if not eng.live(pick(op[1])):
                    break
                eng.step()
            assert not eng.live(pick(op[1]))
        else:
            before = errors(eng)
            faults.arm(op[1])
            eng.step()
            if faults.fired is not None:
                event(f"fault in {op[1].value}")
                failed = errors(eng) - before
                planned = {item.seq.request_id for item in eng.sched.plan.scheduled}
                if op[1] in BATCH:
                    assert planned <= failed
                elif faults.fired[1] is None:  # after the whole batch's bookkeeping: every planned request ended
                    assert planned <= set(eng.ended)
                else:
                    assert failed == {faults.fired[1]}, "a fault in one request's phase failed another"
            faults.armed = None
        eng.step()  # the engine keeps running while requests come and go
    eng.drain()
    for name in ("swap_outs", "recomputes", "cow_copies", "offloads", "cpu_hits", "evictions"):
        if getattr(eng.bm.counters, name):
            event(name)  # what the examples exercised (--hypothesis-show-statistics)
    for m in eng.managers:
        m.check_invariants([])
        assert m.pool.num_available() == m.num_pages
        assert not m.cpu.held_pages() and len(m.cpu.free_pages()) + m.cpu.num_cached() == cpu_pages
    assert set(eng.ended) == {rid for rid in added if rid is not None}, "a request never ended"
    for prompt, out in eng.done.values():
        assert out == isolated(prompt, len(out))
