"""The engine in a process of its own (what the app runs): the same replies as in this process, forks, cancels
and refusals across the socket, and what the app is told when that process dies or cannot load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagedchat import Engine, SamplingParams
from pagedchat.backends.base import Backend, refusal
from pagedchat.backends.local import LocalBackend
from pagedchat.backends.process import STALL_S, STOP_TIMEOUT_S, ProcessBackend
from pagedchat.engine.records import FinishReason, ReplyHandle
from pagedchat.errors import PagedChatError, RequestError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
QUESTION = [{"role": "user", "content": "How do pages share a prefix?"}]


def options(model) -> dict:
    return dict(model=str(model), kv_cache_memory="4MiB", dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def remote(long_tiny_model):
    backend = ProcessBackend(options(long_tiny_model), lambda stage, fraction: None)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def local(long_tiny_model):
    backend = LocalBackend(Engine(**options(long_tiny_model)))
    yield backend
    backend.shutdown()


def wait_until(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_same_reply_as_in_this_process(remote, local):
    assert isinstance(remote, Backend) and remote.info == local.info
    updates = []
    handle = remote.submit(QUESTION, GREEDY, on_update=updates.append)
    assert isinstance(handle, ReplyHandle)
    outcome = handle.result(30)
    expected = local.submit(QUESTION, GREEDY).result(30)
    assert outcome.token_ids == expected.token_ids and outcome.text == expected.text
    assert "".join(u.text for u in updates) == outcome.text and updates[-1].outcome == outcome
    assert remote.prompt_tokens(QUESTION) == local.prompt_tokens(QUESTION) == outcome.prompt_tokens
    # The next turn reuses the ids of the one before, as in this process.
    follow = QUESTION + [{"role": "assistant", "content": outcome.text}, {"role": "user", "content": "And?"}]
    again = remote.submit(follow, GREEDY, previous=outcome).result(30)
    assert again.token_ids == local.submit(follow, GREEDY, previous=expected).result(30).token_ids
    assert again.cached_tokens > 0


def test_the_memory_picture_is_fresh_when_a_reply_ends(remote):
    remote.submit(QUESTION, GREEDY).result(30)
    snap = remote.memory()  # sent ahead of the reply's last update: no poll needed to see it idle
    assert not snap.seqs and snap.used_pages == 0 and snap.cached_pages > 0


def test_fork_cancel_and_so_far(remote):
    # The parent must outlive the check that the fork shares its pages, on a quiet machine too.
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    parent_updates = []
    parent = remote.submit(QUESTION, long, on_update=parent_updates.append)
    wait_until(lambda: sum(u.tokens for u in parent_updates) >= 8)
    assert parent.so_far().prompt_tokens == remote.prompt_tokens(QUESTION)
    fork_updates = []
    fork = remote.fork(parent, long, on_update=fork_updates.append)
    wait_until(lambda: fork_updates)
    wait_until(lambda: any(len(owners) == 2 for owners in remote.memory().shared_pages.values()))
    fork.cancel()
    parent.cancel()
    forked, ended = fork.result(30), parent.result(30)
    assert forked.finish_reason == ended.finish_reason == "cancelled"
    assert forked.finish_reason is FinishReason.CANCELLED   # the enum itself crossed the socket
    # The fork went on from the parent's reply: its prompt is the parent's prompt and tokens at the fork.
    assert fork_updates[0].inherited is not None and forked.prompt_tokens > ended.prompt_tokens
    assert forked.prompt_token_ids == ended.history_ids[:forked.prompt_tokens]
    assert fork.so_far() == forked  # once ended, its figures are the final ones
    late = remote.fork(parent, long)   # refused when the engine process answers
    assert late.result(30).finish_reason == "error" and "finished" in str(refusal(late))


def test_a_refusal_crosses_as_the_same_error(remote, local):
    """submit returns before the engine process answers; its refusal then ends the reply with one error update,
    and refusal() tells it apart from a reply that failed once started."""
    too_long = [{"role": "user", "content": "page " * 5000}]
    with pytest.raises(RequestError) as here:
        local.submit(too_long, GREEDY)
    updates = []
    handle = remote.submit(too_long, GREEDY, on_update=updates.append)
    outcome = handle.result(30)
    assert isinstance(refusal(handle), RequestError) and str(refusal(handle)) == str(here.value)
    assert outcome.finish_reason is FinishReason.ERROR and outcome.error == str(here.value)
    assert [u.outcome for u in updates] == [outcome]
    assert refusal(remote.submit(QUESTION, GREEDY)) is None and refusal(local.submit(QUESTION, GREEDY)) is None


def test_an_idle_engine_process_still_answers(remote):
    """Its heartbeat: with no reply running and nothing asked, it is never taken for stalled."""
    remote.submit(QUESTION, GREEDY).result(30)
    deadline = time.monotonic() + STALL_S * 2
    while time.monotonic() < deadline:
        assert remote.stalled_for() is None
        time.sleep(0.05)


def test_a_stopped_engine_process_holds_up_nothing(long_tiny_model):
    """SIGSTOP mid-reply: submit and fork return at once (a message larger than the socket's buffer too),
    stalled_for() says so within STALL_S and a bit, and after SIGCONT every reply goes on and ends. A process
    stopped again is killed at shutdown at once, not after STOP_TIMEOUT_S."""
    backend = ProcessBackend(options(long_tiny_model), lambda stage, fraction: None)
    try:
        updates = []
        # Long enough to be stopped before it ends (and so still forked) on a quiet machine too.
        running = backend.submit(QUESTION, SamplingParams(max_tokens=3000, ignore_eos=True), on_update=updates.append)
        wait_until(lambda: sum(u.tokens for u in updates) >= 4)
        os.kill(backend.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        huge = [{"role": "user", "content": "page " * 400_000}]   # 2 MB: far more than a socket holds
        started = time.monotonic()
        waiting = backend.submit(QUESTION, GREEDY)
        refused = backend.submit(huge, GREEDY)
        forked = backend.fork(running, GREEDY)
        assert time.monotonic() - started < 0.5
        assert backend.memory() is not None   # the latest picture, without asking
        wait_until(lambda: backend.stalled_for() is not None, timeout=10)
        # Quiet counts from its last message, which came a step or so before the stop.
        assert STALL_S - 0.25 < time.monotonic() - stopped_at < STALL_S + 1.5
        os.kill(backend.pid, signal.SIGCONT)
        assert running.result(30).finish_reason == "length" and waiting.result(30).finish_reason == "length"
        assert forked.result(30).finish_reason == "length" and refusal(forked) is None
        assert isinstance(refusal(refused), RequestError) and refused.result(1).finish_reason == "error"
        assert backend.stalled_for() is None
        os.kill(backend.pid, signal.SIGSTOP)
        wait_until(lambda: backend.stalled_for() is not None, timeout=10)
        started = time.monotonic()
        backend.shutdown()
        assert time.monotonic() - started < STOP_TIMEOUT_S / 2
    finally:
        backend.shutdown()


def test_a_model_that_cannot_load_says_why(tmp_path):
    missing = tmp_path / "no-such-model"
    heard = []
    with pytest.raises(PagedChatError, match="The model could not be loaded: .*no-such-model"):
        ProcessBackend(dict(model=str(missing)), lambda stage, fraction: heard.append(stage), tmp_path / "e.log")


def test_a_killed_engine_ends_its_replies_and_refuses_more(tiny_llama, tmp_path):
    backend = ProcessBackend(options(tiny_llama), lambda stage, fraction: None, tmp_path / "engine.log")
    try:
        updates = []
        reply = backend.submit(QUESTION, SamplingParams(max_tokens=1000, ignore_eos=True),
                               on_update=updates.append)
        wait_until(lambda: sum(u.tokens for u in updates) >= 5)
        os.kill(backend.pid, signal.SIGKILL)  # as the kernel's out-of-memory killer would
        outcome = reply.result(30)
        assert outcome.finish_reason == "error" and "killed by SIGKILL" in outcome.error
        # What came so far is kept.
        assert outcome.text == "".join(u.text for u in updates[:-1])
        assert outcome.generated_tokens == sum(u.tokens for u in updates) >= 5
        assert outcome.prompt_tokens > 0  # the figures so far, for the chat's context indicator
        assert "killed by SIGKILL" in backend.failure
        with pytest.raises(PagedChatError, match="The engine stopped: .*SIGKILL"):
            backend.submit(QUESTION, GREEDY)   # known here: refused at once
    finally:
        backend.shutdown()


def test_shutdown_ends_the_process(tiny_llama):
    backend = ProcessBackend(options(tiny_llama), lambda stage, fraction: None)
    pid = backend.pid
    backend.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert backend.failure is None  # asked to stop: not a failure
    with pytest.raises(PagedChatError, match="shut down"):
        backend.submit(QUESTION, GREEDY)


def test_the_engine_process_goes_when_the_app_is_killed(tiny_llama, tmp_path):
    """Its socket closes with the app, whatever killed it; and the app's process never loads torch."""
    script = (f"import sys; from pagedchat.backends.process import ProcessBackend\n"
              f"b = ProcessBackend({options(tiny_llama)!r}, lambda *a: None)\n"
              f"assert 'torch' not in sys.modules\n"
              f"print(b.pid, flush=True); sys.stdin.read()")
    app = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(app.stdout.readline())
        app.kill()
        app.wait(10)

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return open(f"/proc/{pid}/stat").read().split()[2] == "Z"  # ended, not yet reaped by init

        wait_until(gone)
    finally:
        app.kill()


def test_the_app_borrows_a_core_from_the_engine_process(long_tiny_model):
    """The page the app shares with its engine's process (engine/core_loan.py): while the app asks, the steps leave
    a core and say so; given back, or once the ask runs out (an app that stopped mid-loan), they take it again."""
    backend = ProcessBackend({**options(long_tiny_model), "threads": 2}, lambda stage, fraction: None)
    loan, replies = backend.core_loan, []

    def stepping(condition):
        """condition(), with a reply always in hand, so that steps go on to see the page."""
        if not replies or replies[-1].so_far().finish_reason is not None:
            replies.append(backend.submit(QUESTION, SamplingParams(max_tokens=3000, ignore_eos=True)))
        return condition()

    try:
        assert not loan.lent
        loan.ask(hold_s=30)
        wait_until(lambda: stepping(lambda: loan.lent))
        loan.give_back()
        wait_until(lambda: stepping(lambda: not loan.lent))
        loan.ask(hold_s=30)
        wait_until(lambda: stepping(lambda: loan.lent))
        loan.ask(hold_s=0.3)   # renewed for a moment, then never given back
        wait_until(lambda: stepping(lambda: not loan.lent))
    finally:
        for reply in replies:
            reply.cancel()
        backend.shutdown()
