"""The page through which the app's UI borrows a core from the engine's steps (engine/core_loan.py), and the
engine's side of it (threads.Lender): both processes' views of one page, the engine's steps on one thread fewer
while asked, and back once the core is given back or the ask runs out."""

from __future__ import annotations

import time

import torch

from pagedchat import Engine, SamplingParams
from pagedchat.engine.core_loan import CoreLoan
from pagedchat.engine.threads import Lender, step_threads


def two_views() -> tuple[CoreLoan, CoreLoan]:
    """The app's view and the engine's, as two processes map the page: two mappings of one file."""
    app, page = CoreLoan.create()
    with page:
        return app, CoreLoan(page.fileno())


def test_an_ask_reaches_the_other_view_and_so_does_the_answer():
    app, engine = two_views()
    assert not engine.asked and not app.lent
    app.ask()
    assert engine.asked and not app.lent
    engine.answer(True)
    assert app.lent
    app.give_back()
    assert not engine.asked
    engine.answer(False)
    assert not app.lent


def test_an_ask_not_given_back_runs_out():
    app, engine = two_views()
    app.ask(hold_s=0.05)
    assert engine.asked
    time.sleep(0.1)
    assert not engine.asked


def test_the_lender_leaves_a_core_while_asked_and_returns_to_the_usual_count():
    app, engine = two_views()
    counts, usual = [], [4]
    lender = Lender(engine, counts.append, lambda: usual[0])
    assert not lender.lending() and counts == [] and not app.lent   # nothing asked: nothing set
    app.ask()
    assert lender.lending() and lender.lending() and counts == [3] and app.lent   # set once, answered
    usual[0] = 2      # the governor moved meanwhile: the loan ends on its count
    app.give_back()
    assert not lender.lending() and counts == [3, 2] and not app.lent


def test_one_thread_has_no_core_to_lend_but_says_so():
    app, engine = two_views()
    counts = []
    lender = Lender(engine, counts.append, lambda: 1)
    app.ask()
    assert lender.lending() and counts == [1] and app.lent   # the app need not wait for a core never coming


def test_which_parts_a_team_gets():
    _, loan = two_views()
    assert step_threads(1, False, print, loan) == (None, None)
    governor, lender = step_threads(2, False, print, None)
    assert governor is not None and lender is None
    governor, lender = step_threads(2, True, print, loan)
    assert governor is None and isinstance(lender, Lender)


def test_an_engine_steps_on_one_thread_fewer_while_the_app_borrows_a_core(tiny_llama):
    app, loan = two_views()
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", threads=2, autostart=False, core_loan=loan,
                    speculative="off")
    seen: list[int] = []
    execute = engine.runner.execute

    def counted(plan):
        seen.append(torch.get_num_threads())
        return execute(plan)

    engine.runner.execute = counted
    try:
        engine.submit("Once upon a time", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.step()
        app.ask()
        engine.step()
        engine.step()
        assert app.lent
        app.give_back()
        engine.step()
        assert seen == [2, 1, 1, 2] and not app.lent
    finally:
        engine.shutdown()
