"""An engine process that stops answering (SIGSTOP) never freezes the app: the real app on a pseudo-terminal
says so within a couple of seconds, takes keys and messages meanwhile, goes on when the engine does, and quits
at once with everything saved."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedchat.backends.process import STALL_S
from pty_app import AppProcess, saved, wait_until
from tui_support import make_config

REPLY = 3500   # tokens: long enough to be stopped mid-way (1,500 took half a second on a quiet machine)
ECHO_S = 1.0   # a key typed while the engine is stopped shows within this long (it took about 60 s)


@pytest.fixture
def app(tmp_path, long_tiny_model):
    config = make_config(tmp_path, long_tiny_model)
    app = AppProcess(config.engine.model, config.data_dir, config.config_dir, max_tokens=REPLY, cwd=tmp_path)
    yield app
    app.close()


def replies(app: AppProcess) -> list:
    return [m for m in saved(app.data_dir) if m.role == "assistant"]


def streaming(app: AppProcess):
    """The last reply once it has text saved and is still being written (saved marked interrupted)."""
    last = replies(app)[-1:] or [None]
    return last[0] if last[0] and last[0].content and last[0].finish_reason == "interrupted" else None


def test_a_stopped_engine_is_said_and_holds_up_nothing(app):
    app.send("tell me a long story")
    wait_until(lambda: streaming(app), "the reply to stream")
    engine = app.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_until(lambda: app.shows("not answering"), "the notice", timeout=10)
    noticed = time.monotonic() - stopped
    wait_until(lambda: app.shows("stalled: the engine is not answering"), "the reply marked stalled", timeout=5)
    assert noticed < STALL_S + 1.5, noticed

    # A new chat's message while the engine is stopped: sent (saved at once), and the keys after it show.
    mark = app.received
    app.type("\x0e")   # ctrl+n
    wait_until(lambda: app.shows("New chat", mark), "the new tab", timeout=10)
    app.type("second question")
    wait_until(lambda: app.shows("second question", mark), "the typed message", timeout=10)
    app.type("\r")
    time.sleep(0.3)
    typed, mark = time.monotonic(), app.received
    app.type("xyzzy")
    wait_until(lambda: app.shows("xyzzy", mark), "the key typed after Enter", timeout=10)
    echoed = time.monotonic() - typed
    assert echoed < ECHO_S, echoed
    wait_until(lambda: any(m.content == "second question" for m in saved(app.data_dir)), "the message saved")

    # The engine goes on: the stalled reply finishes, and so does the one sent meanwhile.
    os.kill(engine, signal.SIGCONT)
    wait_until(lambda: app.shows("answering again"), "the all-clear", timeout=10)
    wait_until(lambda: [m.finish_reason for m in replies(app)] == ["length", "length"], "both replies to finish")
    print(f"noticed after {noticed:.2f} s, key echoed after {echoed:.2f} s")


@pytest.mark.slow  # the stall test here stops the engine on a pty; this one quits
def test_quitting_with_a_stopped_engine_is_prompt_and_saves_the_reply(app):
    app.send("tell me a long story")
    wait_until(lambda: streaming(app), "the reply to stream")
    engine = app.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    wait_until(lambda: app.shows("not answering"), "the notice", timeout=10)
    before = streaming(app)
    asked = time.monotonic()
    app.type("\x11")   # ctrl+q
    assert app.wait(timeout=20) == 0, app.screen_tail()
    took = time.monotonic() - asked
    assert took < 5.0, took
    [reply] = replies(app)
    assert reply.finish_reason == "cancelled" and reply.content.startswith(before.content)
    with pytest.raises(ProcessLookupError):   # killed (a stopped process never reads its stop), and reaped
        wait_until(lambda: os.kill(engine, 0) or open(f"/proc/{engine}/stat").read().split()[2] == "Z"
                   and os.kill(engine, 0), "the engine process to go", timeout=5)
    print(f"quit in {took:.2f} s")
