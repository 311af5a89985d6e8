"""Speed figures from token arrival times, and the median of alternating rounds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RunStats:
    """One runner's pass over one level's prompts, all submitted together."""

    tokens: int
    wall_s: float
    end_to_end_tokens_per_s: float
    decode_tokens_per_s: float | None  # from the moment every chat has its first token
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def timing_stats(start: float, arrivals: Sequence[Sequence[float]]) -> RunStats:
    """Speed figures from per-chat token arrival times. TTFT counts from `start` (all chats submitted together)."""
    total = sum(len(a) for a in arrivals)
    end = max(a[-1] for a in arrivals if a)
    firsts = [a[0] for a in arrivals if a]
    ttft = [f - start for f in firsts]
    itl = [b - a for arr in arrivals for a, b in zip(arr, arr[1:])]
    # Decode: from the moment every chat has its first token to the last token, the tokens that arrived in it.
    all_in = max(firsts)
    decoded = sum(1 for arr in arrivals for t in arr if t > all_in)
    span = end - all_in
    return RunStats(
        tokens=total, wall_s=end - start, end_to_end_tokens_per_s=total / (end - start),
        decode_tokens_per_s=decoded / span if span > 0 and decoded else None,
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95),
        itl_p50_s=percentile(itl, 50), itl_p95_s=percentile(itl, 95))


def median_round(rounds: Sequence[RunStats]) -> RunStats:
    """The round with the median end-to-end rate (the lower middle one of an even count)."""
    ranked = sorted(rounds, key=lambda st: st.end_to_end_tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either side has no figure."""
    return ours / theirs if ours and theirs else None
