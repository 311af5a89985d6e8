"""A fresh Python interpreter running one of this pagedchat's functions: the engine process. Imports nothing
heavy: the app's process, which never loads torch, starts the engine with it."""

from __future__ import annotations

import sys
from pathlib import Path

# The working folder leaves the path (a stray torch/ or transformers/ where the user stands would shadow the
# installed package), and this pagedchat's folder joins at the end: found first wherever
# pagedchat is installed, still found where it is not.
_RUN = ("import importlib, sys; del sys.path[0]; sys.path.append(sys.argv[1]); "
        "getattr(importlib.import_module(sys.argv[2]), sys.argv[3])(*sys.argv[4:])")


def command(module: str, function: str, *args: str) -> list[str]:
    """argv that runs module.function(*args) in a new interpreter (args arrive as strings)."""
    root = str(Path(__file__).resolve().parent.parent)
    return [sys.executable, "-c", _RUN, root, module, function, *args]
