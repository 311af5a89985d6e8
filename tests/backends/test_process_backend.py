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
from pagedchat.backends.base import Backend
from pagedchat.backends.local import LocalBackend
from pagedchat.backends.process import ProcessBackend
from pagedchat.engine.records import FinishReason, ReplyHandle
from pagedchat.errors import PagedChatError, RequestError

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
QUESTION = [{"role": "user", "content": "How do pages share a prefix?"}]


def options(model) -> dict:
    return dict(model=str(model), kv_cache_memory="4MiB", dtype="float32")


@pytest.fixture(scope="module")
def remote(tiny_llama):
    backend = ProcessBackend(options(tiny_llama), lambda stage, fraction: None)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def local(tiny_llama):
    backend = LocalBackend(Engine(**options(tiny_llama)))
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
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
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
    with pytest.raises(PagedChatError, match="finished"):
        remote.fork(parent, long)


def test_a_refusal_crosses_as_the_same_error(remote, local):
    too_long = [{"role": "user", "content": "page " * 5000}]
    with pytest.raises(RequestError) as here:
        local.submit(too_long, GREEDY)
    with pytest.raises(RequestError) as there:
        remote.submit(too_long, GREEDY)
    assert str(there.value) == str(here.value)


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
            backend.submit(QUESTION, GREEDY)
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
