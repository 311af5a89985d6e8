"""Each of pagedchat's folders: its environment variable where set (with ~ expanded), else platformdirs'."""

from __future__ import annotations

from pathlib import Path

import platformdirs
import pytest

from pagedchat import paths

FOLDERS = [(paths.cache_dir, "PAGEDCHAT_CACHE_DIR", platformdirs.user_cache_path),
           (paths.config_dir, "PAGEDCHAT_CONFIG_DIR", platformdirs.user_config_path),
           (paths.data_dir, "PAGEDCHAT_DATA_DIR", platformdirs.user_data_path)]


@pytest.mark.parametrize("folder,env,platform", FOLDERS)
def test_the_variable_moves_the_folder_else_the_platform_default(folder, env, platform, monkeypatch, tmp_path):
    monkeypatch.setenv(env, str(tmp_path / "x"))
    assert folder() == tmp_path / "x"
    monkeypatch.setenv(env, "~/y")
    assert folder() == Path("~/y").expanduser()
    for unset in (lambda: monkeypatch.setenv(env, ""), lambda: monkeypatch.delenv(env)):
        unset()  # an empty variable counts as unset, as a shell's `VAR= cmd` means
        assert folder() == platform("pagedchat")
