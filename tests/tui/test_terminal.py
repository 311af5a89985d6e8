"""The app's terminal driver outlives its terminal: once the terminal is hung up, output is dropped instead of
stopping the app (terminal.py). The real app hung up on mid-reply is test_saved_across_processes's."""

from __future__ import annotations

import os
import threading

import pytest

pty = pytest.importorskip("pty")   # a pseudo-terminal to hang up: POSIX

from textual.drivers._writer_thread import MAX_QUEUED_WRITES, WriterThread  # noqa: E402
from textual.drivers.linux_driver import LinuxDriver  # noqa: E402

from pagedchat.tui.app import PagedChatApp  # noqa: E402
from pagedchat.tui.terminal import TerminalDriver, TerminalOutput  # noqa: E402
from tui_support import make_config  # noqa: E402

UPDATES_S = 5.0   # far longer than queueing a hundred writes takes


def hung_up_terminal():
    """A pseudo-terminal's end, as the app holds it, after its window closed: each write to it fails."""
    ours, theirs = pty.openpty()
    os.close(ours)
    return os.fdopen(theirs, "w")


def close(terminal) -> None:
    try:
        terminal.close()
    except OSError:   # the flush of what its buffer holds: the terminal is gone
        pass


def screen_updates_end(output) -> bool:
    """Textual's output thread over `output`, and many more screen updates than its queue holds: whether they
    all went out (else the app's loop is stuck in one of them)."""
    writer = WriterThread(output)
    writer.start()
    done = threading.Event()

    def updates() -> None:
        for _ in range(3 * MAX_QUEUED_WRITES):
            writer.write("\x1b[Hframe\n")
        writer.stop()
        done.set()

    threading.Thread(target=updates, daemon=True).start()
    return done.wait(UPDATES_S)


def test_a_hung_up_terminal_drops_the_screen_updates_instead_of_blocking():
    terminal = hung_up_terminal()
    output = TerminalOutput(terminal)
    try:
        assert screen_updates_end(output)
        assert output.gone
    finally:
        close(terminal)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # its thread's end
def test_textual_alone_blocks_there():
    """Why the driver wraps its output: without it the first failed write ends Textual's output thread, and the
    updates after a full queue wait forever. If a Textual release stops this, terminal.py can go."""
    terminal = hung_up_terminal()
    try:
        assert not screen_updates_end(terminal)
    finally:
        close(terminal)


def test_the_app_runs_on_that_driver(tmp_path, monkeypatch):
    monkeypatch.delenv("TEXTUAL_DRIVER", raising=False)
    assert issubclass(TerminalDriver, LinuxDriver)
    assert PagedChatApp(make_config(tmp_path)).driver_class is TerminalDriver
