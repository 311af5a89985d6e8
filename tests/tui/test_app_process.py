"""The real app on a pseudo-terminal, for what only a running app shows: it starts despite a broken theme file,
asks before quitting with chats it could not save, and keeps each chat's unsent input across a restart."""

from __future__ import annotations

import os

import pytest

from pty_app import AppProcess, wait_until
from tiny_models import make_tiny_model
from tui_support import make_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pty-model"), seed=1, max_positions=256)


@pytest.fixture
def config(tmp_path, model):
    return make_config(tmp_path, model)


@pytest.fixture
def launch(config, tmp_path):
    started: list[AppProcess] = []

    def start(max_tokens: int = 8, data_dir=None) -> AppProcess:
        app = AppProcess(config.engine.model, data_dir or config.data_dir, config.config_dir, max_tokens=max_tokens,
                         cwd=tmp_path)
        started.append(app)
        return app

    yield start
    for app in started:
        app.close()


def shows(app: AppProcess, text: str) -> bool:
    return text in app.output.decode(errors="replace")


def exited(app: AppProcess) -> bool:
    """The app is gone (its exit code then in app.status): a wait on the screen need not run out first."""
    if app.status is None:
        pid, status = os.waitpid(app.pid, os.WNOHANG)
        if pid:
            app.status = os.waitstatus_to_exitcode(status)
    return app.status is not None


@pytest.mark.parametrize("value", ["#336699 {", "#336699;"])
def test_a_theme_textual_cannot_read_is_skipped_and_the_app_starts(launch, config, value):
    """Such a value raised Textual's TokenError while the themes were read, before the first paint, even with
    the theme never chosen: the app died with a traceback."""
    config.user_theme_dir.mkdir(parents=True)
    (config.user_theme_dir / "broken.toml").write_text(f'name = "broken"\nprimary = "#336699"\n[variables]\n'
                                                       f'text-muted = "{value}"\n')
    app = launch()
    wait_until(lambda: shows(app, "Theme skipped: broken.toml") or exited(app), "the notice")
    assert not exited(app) and shows(app, "not a value Textual's CSS can read"), app.screen_tail()
    app.type("\x11")  # ctrl+q: nothing unsaved, so it quits at once
    assert app.wait() == 0, app.screen_tail()
