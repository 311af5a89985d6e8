"""The real app in subprocesses: killed (SIGKILL), hung up on (SIGHUP), terminated (SIGTERM) mid-reply, and
two instances on one database. What they saved is read from the database; the restart is the app itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from pty_app import AppProcess, saved, wait_until
from slow_cases import slow_after
from pagedchat.tui.app import PagedChatApp
from pagedchat.engine.records import FinishReason
from pagedchat.tui.conversation import ChatMessage, ChatRecord
from pagedchat.tui.store import DB_NAME, Store
from tiny_models import make_tiny_model
from tui_support import make_config, screen_text, wait_for

LONG = 3000    # tokens: several seconds of reply, cut short by the tests
SHORT = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("proc-model"), seed=1, max_positions=4096)


@pytest.fixture
def config(tmp_path, model):
    return make_config(tmp_path, model)


@pytest.fixture
def launch(config, tmp_path):
    started: list[AppProcess] = []

    def start(max_tokens: int) -> AppProcess:
        app = AppProcess(config.engine.model, config.data_dir, config.config_dir, max_tokens=max_tokens, cwd=tmp_path)
        started.append(app)
        return app

    yield start
    for app in started:
        app.close()


def partial_reply(data_dir):
    """The reply being written, once it has text: saved while it grows, marked interrupted until it ends."""
    replies = [m for m in saved(data_dir) if m.role == "assistant"]
    last = replies[-1] if replies else None
    return last if last and last.content and last.finish_reason == FinishReason.INTERRUPTED else None


async def restarted_shows(config, text: str) -> None:
    """Start the app again on the same data dir: the reply is there, with its text and the mark."""
    app = PagedChatApp(config)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.sessions and app.active_session.record.messages, "the restored chat")
        reply = app.active_session.record.messages[-1]
        assert reply.content == text and reply.stats.finish_reason == FinishReason.INTERRUPTED
        await wait_for(pilot, lambda: "interrupted" in screen_text(app), "the interrupted mark on screen")


async def test_kill_9_mid_reply_keeps_the_partial_reply(launch, config):
    app = launch(LONG)
    app.send("tell me a long story")
    first = wait_until(lambda: partial_reply(config.data_dir), "a partial reply saved")
    # Saved as it grows: a later save has more text, well within a second or two.
    grown = wait_until(lambda: (r := partial_reply(config.data_dir)) and len(r.content) > len(first.content) and r,
                       "the saved reply to grow", timeout=10)
    app.signal(signal.SIGKILL)
    assert app.wait() == -signal.SIGKILL
    after = partial_reply(config.data_dir)
    assert after is not None and after.content.startswith(grown.content)
    await restarted_shows(config, after.content)


@pytest.mark.parametrize("how", slow_after(["hang up", "SIGTERM"]))
async def test_closed_terminal_or_sigterm_saves_and_exits_cleanly(launch, config, how):
    app = launch(LONG)
    app.send("tell me a long story")
    seen = wait_until(lambda: partial_reply(config.data_dir), "a partial reply saved")
    if how == "hang up":
        os.close(app.fd)   # the terminal closed, as closing its window does: the kernel sends SIGHUP
        app.fd = -1
    else:
        app.signal(signal.SIGTERM)
    assert app.wait() == 0, app.screen_tail()  # the handler ran: killed by the signal would be negative
    after = partial_reply(config.data_dir)
    assert after is not None and after.content.startswith(seen.content)
    await restarted_shows(config, after.content)


@pytest.mark.slow  # two app processes: test_store keeps two instances' messages in one process
def test_two_instances_on_one_chat_keep_both_turns(launch, config):
    """Both restore the same open chat and each adds a turn; both quit. Before per-message saves, each
    instance rewrote the whole chat from its own copy and the last to save deleted the other's turn."""
    store = Store.open(config.data_dir)
    store.save_chat(ChatRecord(title="shared", messages=[ChatMessage("user", "hi"), ChatMessage("assistant", "hey")]))
    store.close()
    first, second = launch(SHORT), launch(SHORT)
    first.send("from the first window")
    second.send("from the second window")

    def finished():
        replies = [m for m in saved(config.data_dir) if m.role == "assistant"]
        return len(replies) == 3 and all(m.finish_reason in ("length", "stop") for m in replies[1:])

    try:
        wait_until(finished, "both replies to finish")
    except AssertionError:
        raise AssertionError(f"{saved(config.data_dir)}\n{first.screen_tail()}") from None
    for app in (first, second):
        app.type("\x11")  # ctrl+q
    assert first.wait() == 0 and second.wait() == 0
    messages = saved(config.data_dir)
    assert len({m.chat_id for m in messages}) == 1
    users = sorted(m.content for m in messages if m.role == "user")
    assert users == ["from the first window", "from the second window", "hi"]
    assert [m.content for m in messages[:2]] == ["hi", "hey"]
    # A random model's reply may be empty when it stopped at once (its first pick an end token, by how the two
    # turns raced); every other reply keeps its text.
    replies = [m for m in messages if m.role == "assistant"]
    assert len(messages) == 6 and all(m.finish_reason in ("length", "stop") for m in replies[1:])
    assert all(m.content or m.finish_reason == "stop" for m in replies)


def set_immutable(on: bool, paths) -> bool:
    """chattr ±i: what a file system gone read-only does to SQLite's writes (needs root, and ext4 or the like)."""
    done = subprocess.run(["chattr", "+i" if on else "-i", *map(str, paths)], capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize("frozen", slow_after(["shm", "all"]))
def test_an_unwritable_database_mid_reply_is_survived_and_the_reply_is_kept(launch, config, frozen):
    """"shm": SQLite's memory-mapped WAL index made immutable mid-reply, as the issue did: in WAL mode the next
    commit wrote to the mapping and the app died with SIGBUS (exit 135), its reply kept only to its last save.
    The store keeps no such file now, so nothing may kill it. "all": the database, its side files and its
    folder: every save fails, with the notice, and the retries write the reply once they can."""
    app = launch(LONG)
    app.send("tell me a long story")
    wait_until(lambda: partial_reply(config.data_dir), "a partial reply saved")
    shm = list(config.data_dir.glob(DB_NAME + "-shm"))
    paths = shm if frozen == "shm" else [config.data_dir, *config.data_dir.glob(DB_NAME + "*")]
    if shutil.which("chattr") is None or not set_immutable(True, [config.data_dir]) \
            or not set_immutable(False, [config.data_dir]):
        pytest.skip("chattr +i is not available here (it needs root and a file system that has it)")
    # Waited for, not read once: saved() takes a failed read for no rows, and one CI run read none here.
    stuck = wait_until(lambda: partial_reply(config.data_dir), "the partial reply read back")
    try:
        assert not paths or set_immutable(True, paths)
        if frozen == "all":
            wait_until(lambda: "Could not save chats" in app.output.decode(errors="replace"), "the notice")
        time.sleep(1.5)   # several saves (twice a second) meanwhile
        assert os.waitpid(app.pid, os.WNOHANG) == (0, 0), app.screen_tail()   # still running
        if frozen == "all":
            assert partial_reply(config.data_dir) == stuck   # nothing was written: the file really was unwritable
    finally:
        if paths:
            set_immutable(False, paths)
    # The reply finishes, whole, on disk (after the retries, where saves failed).
    finished = wait_until(lambda: [m for m in saved(config.data_dir) if m.role == "assistant"
                                   and m.finish_reason == "length"], "the whole reply saved")
    assert finished[0].content.startswith(stuck.content) and len(finished[0].content) > len(stuck.content)
    app.type("\x11")  # ctrl+q
    assert app.wait() == 0, app.screen_tail()
