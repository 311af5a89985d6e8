"""The page bookkeeping's self-checks: each part states its invariants with `require`, and a broken one raises
PoolCorrupted (a bug, never bad input), whatever python's -O says. No torch here."""

from __future__ import annotations


class PoolCorrupted(AssertionError):
    """The page bookkeeping contradicts itself (a bug); raised by check_invariants, even under python -O."""


def require(condition: bool, what: str) -> None:
    if not condition:
        raise PoolCorrupted(what)
