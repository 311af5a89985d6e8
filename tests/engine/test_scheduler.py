"""The scheduler as the one writer of a sequence's status and num_computed (engine/scheduler.py), and its fair
share of the batch per request."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from fake_engine import FakeEngine, isolated, make_seq, toks
from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.detokenizer import ReplyText
from pagedchat.engine.ngram import Drafter
from pagedchat.engine.sequence import SeqStatus, Sequence

PACKAGE = Path(__file__).resolve().parents[2] / "pagedchat"
ENGINE = PACKAGE / "engine"
# A sequence's counters: moved by the core's steps and the scheduler's admissions alone.
COUNTERS = {"num_computed", "cached_tokens", "prefilled_tokens", "prefix_counted", "drafted", "accepted"}


def attribute_writes(names: set[str]) -> set[tuple[str, str, str]]:
    """(module, function, attribute) of every assignment to an attribute of one of these names in the package."""
    writes = set()
    for path in PACKAGE.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for t in targets:
                    for leaf in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(leaf, ast.Attribute) and leaf.attr in names:
                            writes.add((str(path.relative_to(PACKAGE)), fn.name, leaf.attr))
    return writes


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
    assert not new.table(0).cpu_table and not pages.first.cpu.held_pages()


def test_only_the_scheduler_writes_a_sequence_status():
    writers = set()
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
                writers.add(path.name)
    assert writers == {"scheduler.py"}


def test_num_computed_moves_in_one_method_and_counters_in_the_core_and_the_scheduler():
    writes = attribute_writes(COUNTERS)
    assert {w for w in writes if w[2] == "num_computed"} == {("engine/scheduler.py", "set_computed", "num_computed")}
    assert {module for module, _, _ in writes} == {"engine/core.py", "engine/scheduler.py"}


def test_a_sequence_keeps_no_decoding_or_drafting_state():
    """The reply's text and the incremental decode's offsets are the detokenizer's (engine/detokenizer.py), the
    n-gram index and the next draft's length the Speculation's (engine/ngram.py)."""
    kept = {f.name for f in dataclasses.fields(Sequence)}
    assert not kept & {f.name for state in (ReplyText, Drafter) for f in dataclasses.fields(state)}


def test_a_preemption_for_recompute_forgets_the_hashes_of_every_layer_group():
    """With no CPU tier the victim gives back its pages in both groups, and its hashes too: it is admitted anew."""
    pages = PageGroups((BlockManager(10, 4), BlockManager(10, 4, group=1, window=6)))
    scheduler = Scheduler(pages, max_tokens_per_step=64, max_seqs=4)
    old, new = make_seq(toks(16), "old"), make_seq(toks(16, 1), "new")
    for seq in (old, new):
        scheduler.add(seq)
    for item in scheduler.schedule().scheduled:
        scheduler.set_computed(item.seq, item.seq.num_computed + item.num_tokens)
    pages.end_step()
    assert all(seq.table(g).page_hashes for seq in (old, new) for g in (0, 1))
    old.token_ids += toks(12, 2)  # old needs three pages more than the global pool has left: new goes
    scheduler.schedule()
    assert new.status is SeqStatus.WAITING and new.num_computed == 0 and pages.counters.recomputes == 1
    assert [new.table(g).page_hashes for g in (0, 1)] == [[], []]


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
