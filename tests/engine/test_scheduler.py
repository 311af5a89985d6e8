"""The scheduler as the one writer of a sequence's status (engine/scheduler.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from fake_engine import FakeEngine, isolated, make_seq, toks
from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.sequence import SeqStatus

ENGINE = Path(__file__).resolve().parents[2] / "pagedchat" / "engine"


def test_each_queue_move_sets_the_status_and_finish_ends_it():
    pages = PageGroups((BlockManager(8, 16, num_cpu_pages=8),))
    scheduler = Scheduler(pages, max_tokens_per_step=64, max_seqs=4)
    old, new = make_seq(toks(40), "old"), make_seq(toks(40, 1), "new")
    scheduler.add(old)
    scheduler.add(new)
    assert old.status is new.status is SeqStatus.WAITING
    plan = scheduler.schedule()
    assert [s.seq for s in plan.scheduled] == [old, new] and old.status is new.status is SeqStatus.RUNNING
    for item in plan.scheduled:
        item.seq.num_computed += item.num_tokens
    pages.end_step()
    old.token_ids += toks(60, 2)  # old needs four pages more than the pool has left: new is swapped out
    scheduler.schedule()
    assert new.status is SeqStatus.SWAPPED and scheduler.swapped[0] is new
    scheduler.finish(new)
    assert new.status is SeqStatus.FINISHED and new not in scheduler.all_seqs()
    assert not new.cpu_table and not pages.first.cpu.held_pages()


def test_only_the_scheduler_writes_a_sequence_status():
    writers = set()
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
                writers.add(path.name)
    assert writers == {"scheduler.py"}


# ---- a fair share for every request ----------------------------------------------------------------------------
def _run_with_innocent(flood_requests: int, n: int, steps_before: int = 3):
    """Requests of n long replies fill the batch and the pool; one short request comes in after them. Returns the
    engine, the innocent's id, the steps it took to finish and whether it was ever preempted."""
    eng = FakeEngine(num_pages=48, cpu_pages=400, budget=16, max_seqs=8)
    for i in range(flood_requests):
        eng.add(toks(6, i), 120, n=n)
    for _ in range(steps_before):
        eng.step()
    innocent = eng.add(toks(5, 9), 8)
    steps, preempted = 0, False
    while innocent not in eng.ended:
        eng.step()
        steps += 1
        seq = eng.core.sequence(innocent)
        preempted |= seq is not None and seq.status is SeqStatus.SWAPPED
    eng.drain()
    return eng, innocent, steps, preempted


def test_a_request_beside_floods_of_n_gets_a_slot_and_keeps_it():
    """Two requests of n=8 hold every slot of the batch and outgrow the pool: a request of one reply that comes
    after them joins within a step or two (taking a slot from the largest) and is never the one preempted, so it
    ends in about its own length. Every reply is still exact, and every page comes back."""
    eng, innocent, steps, preempted = _run_with_innocent(flood_requests=2, n=8)
    assert steps <= 8 + 2 and not preempted
    assert eng.bm.counters.swap_outs > 0   # the pool was short: the flood's own replies were preempted
    assert len(eng.done) == 2 * 8 + 1
    for prompt, out in eng.done.values():
        assert out == isolated(prompt, len(out))
    assert eng.bm.pool.num_available() == eng.bm.num_pages


def test_among_requests_of_one_reply_the_newest_is_preempted_first():
    """With equal shares, first come, first served: the oldest requests keep their pages."""
    eng = FakeEngine(num_pages=12, cpu_pages=100, budget=12, max_seqs=8)
    ids = [eng.add(toks(4, i), 16) for i in range(4)]   # 5 pages each at the end: not all four fit
    first_swapped = None
    while len(eng.ended) < 4:
        eng.step()
        swapped = [rid for rid in ids if (s := eng.core.sequence(rid)) is not None and s.status is SeqStatus.SWAPPED]
        first_swapped = first_swapped or (swapped and swapped[0])
    assert first_swapped == ids[-1]
    assert all(eng.done[rid][1] == isolated(toks(4, i), 16) for i, rid in enumerate(ids))
