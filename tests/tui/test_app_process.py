"""The real app on a pseudo-terminal, for what only a running app shows: it starts despite a broken theme file,
asks before quitting with chats it could not save, and keeps each chat's unsent input across a restart."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from pty_app import AppProcess, saved, wait_until
from slow_cases import slow_after
from pagedchat.bench.app_probe import PLACEHOLDER
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.transfer import read_chat_file
from test_saved_across_processes import SHORT, config, launch  # noqa: F401  (fixtures, over this file's model)
from tiny_models import make_tiny_model
from tui_support import quick_pilot, wait_for  # noqa: F401  (quick_pilot: autouse)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A context of 256 tokens, so that a message typed is soon too long for it."""
    return make_tiny_model(tmp_path_factory.mktemp("pty-model"), seed=1, max_positions=256)


def shows(app: AppProcess, text: str) -> bool:
    return text in app.output.decode(errors="replace")


def exited(app: AppProcess) -> bool:
    """The app is gone (its exit code then in app.status): a wait on the screen need not run out first."""
    if app.status is None:
        pid, status = os.waitpid(app.pid, os.WNOHANG)
        if pid:
            app.status = os.waitstatus_to_exitcode(status)
    return app.status is not None


@pytest.mark.parametrize("value", slow_after(["#336699 {", "#336699;"]))
def test_a_theme_textual_cannot_read_is_skipped_and_the_app_starts(launch, config, value):
    """Such a value raised Textual's TokenError while the themes were read, before the first paint, even with
    the theme never chosen: the app died with a traceback."""
    config.user_theme_dir.mkdir(parents=True)
    (config.user_theme_dir / "broken.toml").write_text(f'name = "broken"\nprimary = "#336699"\n[variables]\n'
                                                       f'text-muted = "{value}"\n')
    app = launch(SHORT)
    wait_until(lambda: shows(app, "Theme skipped: broken.toml") or exited(app), "the notice")
    assert not exited(app) and shows(app, "not a value Textual's CSS can read"), app.screen_tail()
    app.type("\x11")  # ctrl+q: nothing unsaved, so it quits at once
    assert app.wait() == 0, app.screen_tail()


@pytest.fixture
def small_disk(config):
    """The data dir on a 1 MiB file system of its own (tmpfs: needs root, or the test is skipped), unmounted
    afterwards."""
    mount = config.data_dir
    mount.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)   # lazy: an app still closing keeps no hold


def fill(disk) -> None:
    """Fill the file system to the last byte, as a disk runs full."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (64 * 1024, 1024, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def with_a_turn_it_cannot_save(launch, data):
    """The app with one saved turn, then its disk run full and a second message sent: that turn is only in
    memory."""
    app = launch(SHORT)
    app.send("first message")
    # Finished, not a snapshot saved while it streams (those say "interrupted"): the next message is refused
    # while the chat is still replying.
    wait_until(lambda: [m for m in saved(data) if m.role == "assistant" and m.finish_reason
                        and m.finish_reason != "interrupted"], "the first reply")
    fill(data)
    app.type("second message\r")
    wait_until(lambda: shows(app, "Could not save chats"), "the save error")
    assert "second message" not in [m.content for m in saved(data)]
    app.type("\x11")  # ctrl+q
    wait_until(lambda: shows(app, "Esc keeps trying") or exited(app), "the question before quitting")
    assert not exited(app) and shows(app, "1 chat could not be saved"), app.screen_tail()
    time.sleep(0.5)  # focus reaches the dialog's field just after its first paint
    return app


@pytest.mark.slow  # test_tui_saving drives the quit question in process; export is test_tui's and test_cli's
def test_quitting_with_unsaved_chats_exports_them_where_the_user_says(launch, small_disk, tmp_path):
    """ctrl+q used to exit at once: the turn that could not be saved was lost."""
    app = with_a_turn_it_cannot_save(launch, small_disk)
    rescue = tmp_path / "rescue"
    app.type(str(rescue) + "\r")   # the suggested folder is selected: typing replaces it; Enter exports
    assert app.wait() == 0, app.screen_tail()
    [exported] = list(rescue.glob("*.json"))
    chat = read_chat_file(exported)   # what `pagedchat import` reads
    assert [m.content for m in chat.messages if m.role == "user"] == ["first message", "second message"]
    assert "second message" not in [m.content for m in saved(small_disk)]   # it really was unsaved


@pytest.mark.slow  # test_tui_saving asks and quits once saved, in process
def test_quitting_with_unsaved_chats_waits_and_quits_once_they_are_saved(launch, small_disk):
    app = with_a_turn_it_cannot_save(launch, small_disk)
    (small_disk / "filler").unlink()   # space again: the next retry writes the turn, and the app quits
    assert app.wait() == 0, app.screen_tail()
    assert "second message" in [m.content for m in saved(small_disk)]


@pytest.mark.slow  # the export case here takes the same dialog on a pty
def test_quit_anyway_leaves_and_says_what_was_lost(launch, small_disk):
    app = with_a_turn_it_cannot_save(launch, small_disk)
    app.type("\t\t\t\r")   # from the folder to Export, Keep trying, Quit (losing them)
    assert app.wait() == 0, app.screen_tail()
    assert "second message" not in [m.content for m in saved(small_disk)]
    assert shows(app, "the latest changes could not be saved"), app.screen_tail()


@pytest.mark.slow  # test_tui_saving reopens a chat with its unsent input, in process
async def test_a_message_refused_as_too_long_is_still_in_the_input_after_a_restart(launch, config):
    """It stayed in the input, but a quit lost it: drafts were not saved."""
    app = launch(SHORT)
    wait_until(lambda: PLACEHOLDER in app.output, "the app to show its input")
    time.sleep(0.3)  # focus arrives just after the first paint
    text = "far too long " * 150   # more tokens than the model's 256 of context
    app.type(text)
    # Enter until the model is loaded and the check refuses it (before, Enter only says it is loading).
    wait_until(lambda: shows(app, "back in the input"), "the refusal", nudge=lambda: app.type("\r"))
    app.type("\x11")  # ctrl+q
    assert app.wait() == 0, app.screen_tail()
    assert not saved(config.data_dir)   # nothing was sent
    restarted = PagedChatApp(config)
    async with restarted.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: restarted.active_chat is not None, "the restored chat")
        assert restarted.active_chat.prompt.text == text


def test_keys_typed_straight_after_ctrl_n_go_to_the_new_chat(launch, config):
    """Typed in one burst with ctrl+n (a quick typist, a paste), they were lost: the new tab's input took focus
    only after the keys that came while the tab opened, which found nothing focused."""
    app = launch(SHORT)
    app.send("first question")
    mark = app.received
    app.type("\x0esecond question")
    wait_until(lambda: app.shows("second question", mark), "the keys in the new chat's input", timeout=20)
    app.type("\r")
    wait_until(lambda: len({m.chat_id for m in saved(config.data_dir) if m.role == "user"}) == 2,
               "the second chat's message saved", nudge=lambda: app.type("\r"))
    asked = [m.content for m in saved(config.data_dir) if m.role == "user"]
    assert sorted(asked) == ["first question", "second question"], asked
