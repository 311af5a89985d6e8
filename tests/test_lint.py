"""The code passes ruff's checks as pyproject.toml configures them: unused or undefined names, shadowed
definitions, bugbear's likely bugs and lines past 120 characters fail the suite, not a reviewer's eye."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    done = subprocess.run([ruff, "check", "--no-cache", "pagedchat", "tests"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
