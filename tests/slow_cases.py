"""Which cases of a parametrized test the fast run (`pytest -m "not slow"`) keeps: the first few, enough to
exercise the code; the full run (`pytest`, CI) runs every case."""

from __future__ import annotations

import pytest


def slow_after(cases, keep: int = 1) -> list:
    """cases as pytest parameters, every one after the first `keep` marked slow. A tuple is one case of
    several arguments."""
    return [pytest.param(*case if isinstance(case, tuple) else (case,), marks=[pytest.mark.slow] if i >= keep else [])
            for i, case in enumerate(cases)]
