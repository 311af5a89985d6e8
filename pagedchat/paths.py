"""Where pagedchat keeps its files: an environment variable where set, else the platform's user folder.

This module imports nothing heavy (platformdirs only when a default is asked for): `pagedchat --help` reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

APP = "pagedchat"
CACHE_DIR_ENV = "PAGEDCHAT_CACHE_DIR"
CONFIG_DIR_ENV = "PAGEDCHAT_CONFIG_DIR"
DATA_DIR_ENV = "PAGEDCHAT_DATA_DIR"


def _user_dir(env: str, kind: str) -> Path:
    """$env (user-expanded) where set and not empty, else platformdirs' user_<kind>_path for pagedchat."""
    override = os.environ.get(env)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return getattr(platformdirs, f"user_{kind}_path")(APP)


def cache_dir() -> Path:
    """Pulled and converted models, packed weights, tokenizer records; PAGEDCHAT_CACHE_DIR moves it."""
    return _user_dir(CACHE_DIR_ENV, "cache")


def config_dir() -> Path:
    """config.toml and user themes; PAGEDCHAT_CONFIG_DIR moves it."""
    return _user_dir(CONFIG_DIR_ENV, "config")


def data_dir() -> Path:
    """Saved chats and exports; PAGEDCHAT_DATA_DIR moves it."""
    return _user_dir(DATA_DIR_ENV, "data")
