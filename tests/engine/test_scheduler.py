"""The scheduler as the one writer of a sequence's status (engine/scheduler.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from fake_engine import make_seq, toks
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
