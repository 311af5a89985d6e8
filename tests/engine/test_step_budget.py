"""A step's token budget (engine/scheduler.py): sized in time by a StepTimer, and not spent on tokens that a
page being written this step will serve next step."""

from __future__ import annotations

import pytest
from fake_engine import make_seq, toks
from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.scheduler import Scheduler, StepPlan, StepTimer
from pagedchat.engine.sequence import SeqStatus

BS = 16


def run(scheduler: Scheduler, pages: PageGroups) -> StepPlan:
    """One step without a model: plan it, count its chunks computed and append a token where one is sampled,
    end it."""
    plan = scheduler.schedule()
    for item in plan.scheduled:
        scheduler.set_computed(item.seq, item.seq.num_computed + item.num_tokens)
        if item.samples:
            item.seq.token_ids.append(1)
    pages.end_step()
    return plan


def chunks(plan: StepPlan) -> dict[str, int]:
    return {item.seq.request_id: item.num_tokens for item in plan.scheduled}


def test_chats_continuing_into_a_page_written_this_step_wait_for_it_and_let_others_by():
    """Chats that come with the first on one system prompt, which ends inside a page: the first computes it, the
    others wait one step and then copy that page, computing their own tokens alone. A chat on another prompt,
    queued behind them, is not held up."""
    pages = PageGroups((BlockManager(64, BS),))
    scheduler = Scheduler(pages, max_tokens_per_step=512, max_seqs=8)
    system = toks(2 * BS + 8)
    first = make_seq(system + toks(10, 1), "first")
    same = [make_seq(system + toks(5, 2 + i), f"same{i}") for i in range(3)]
    other = make_seq(toks(20, 9), "other")
    for seq in (first, *same, other):
        scheduler.add(seq)
    assert chunks(run(scheduler, pages)) == {"first": 50, "other": 20}
    assert all(seq.status is SeqStatus.WAITING and not seq.prefix_counted for seq in same)
    assert chunks(run(scheduler, pages)) == {"first": 1, "other": 1, **{seq.request_id: 5 for seq in same}}
    assert [seq.cached_tokens for seq in same] == [len(system)] * 3
    assert pages.counters.cow_copies == 3


def test_a_timer_sizes_steps_from_those_of_its_least_tokens_or_more():
    timer = StepTimer(seconds=0.5, least=64)
    assert timer.tokens(512) == 64, "nothing measured yet: the least"
    timer.observe(32, 0.001)
    assert timer.tokens(512) == 64, "a step of fewer tokens mostly reads the weights: not a measure"
    timer.observe(100, 1.0)
    assert timer.tokens(512) == 64, "0.01 s a token: 50, raised to the least"
    timer.observe(200, 0.2)
    assert timer.per_token == (0.01 + 0.001) / 2 and timer.tokens(512) == 90
    assert timer.tokens(80) == 80 and timer.tokens(32) == 32, "never above the most"
    with pytest.raises(ValueError, match="step_seconds must be a number of seconds above 0"):
        StepTimer(seconds=0)


def test_a_scheduler_with_a_timer_cuts_a_prompt_into_chunks_of_its_budget():
    pages = PageGroups((BlockManager(64, BS),))
    scheduler = Scheduler(pages, max_tokens_per_step=512, max_seqs=8, timer=StepTimer(seconds=1.0, least=64))
    long, late = make_seq(toks(300), "long"), make_seq(toks(90, 1), "late")
    scheduler.add(long)
    plan = run(scheduler, pages)
    assert chunks(plan) == {"long": 64}, "a first step of the least, to measure"
    scheduler.observe(plan, 64 / 100)  # 100 tokens a second: a second's step is 100 tokens
    scheduler.add(late)
    assert chunks(run(scheduler, pages)) == {"long": 100}, "the oldest running prompt takes the budget first"
    run(scheduler, pages)
    plan = run(scheduler, pages)
    assert chunks(plan) == {"long": 36, "late": 64}
    scheduler.observe(plan, 0.01)
    assert scheduler.step_tokens() == int(1.0 / ((0.01 + 0.0001) / 2)), "averaged with the last step's cost"
