"""How many threads a step's torch ops use when the user did not say: the most that pay, found from the steps.

The kernels split each parallel loop evenly over the team and meet at a barrier, about ten times a layer. On a
quiet machine one thread per core is fastest. Once another process takes a core, the thread that shares it
finishes its part a time slice late, and every barrier waits for it: a step can run several times slower than on
one thread. So the governor times the steps and tries a neighbouring count now and then: at once when the steps
slow down against the best this count has done, and on a timer that backs off while nothing changes. A count is
kept only when its steps were clearly faster than the current count's on steps of the same size.

Where /proc tells what other processes take, the governor reads it too: the first count leaves the cores they kept
busy while the engine got ready, and a timed try of more threads waits while they still hold the cores it would
need. On a busy machine a try of more threads costs several slow steps, and a short reply much of its time.

Torch-free: the engine passes the call that sets the count, the clock and the CPU reading.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("pagedchat.engine")

SLOWED = 1.5          # a step this much slower than this count's best for its size: try fewer threads now
ADOPT = 0.85          # a tried count is kept when its steps take at most this share of the current count's
PROBE_STEPS = 4       # steps a tried count runs; the first, which may form the new team, is not compared
FIRST_INTERVAL = 1.0  # seconds between timed tries after a change; doubled after each try that lost
LAST_INTERVAL = 30.0
MIN_GAP = 0.5         # seconds between tries that slowed steps start
FRESH = 3.0           # a count's timing of a step size is compared only this long after it was last seen
EWMA = 0.3
MIN_READING = 0.05    # seconds: a shorter look at the other processes' CPU time says too little

CpuReading = Callable[[], Optional[tuple[float, float]]]


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process has been busy, this process's), from /proc; None without it. Busy counts steal,
    the time another virtual machine held a core."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        with open("/proc/self/stat") as f:
            utime, stime = map(int, f.read().rsplit(")", 1)[1].split()[11:13])
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (utime + stime) / tick


def ladder(most: int) -> tuple[int, ...]:
    """The counts tried, most first: every core, one fewer (another process took one), halves down to one."""
    counts = {most, max(most - 1, 1), 1}
    half = most
    while half > 1:
        half //= 2
        counts.add(max(half, 1))
    return tuple(sorted(counts, reverse=True))


@dataclass
class _Timing:
    """One count's steps of one size: a moving average, the best, and when it was last seen."""

    mean: float
    best: float
    seen: float
    steps: int = 1

    def add(self, seconds: float, now: float) -> None:
        self.mean += EWMA * (seconds - self.mean)
        self.best = min(self.best, seconds)
        self.seen = now
        self.steps += 1


@dataclass
class _Probe:
    rung: int
    times: list[tuple[int, float]] = field(default_factory=list)  # (step size, seconds)


class ThreadGovernor:
    def __init__(self, most: int, set_threads: Callable[[int], None], clock: Callable[[], float],
                 cpu: CpuReading = lambda: None):
        self.counts = ladder(most)
        self._set = set_threads
        self._clock = clock
        self._cpu = cpu
        self._reading = (clock(), cpu())          # the last look at the CPU time: see _free_cores
        self._first_step = True
        self._rung = 0                                       # index into counts: the count in use
        self._timings: dict[tuple[int, int], _Timing] = {}   # (rung, step size) -> timing
        self._probe: _Probe | None = None
        self._interval = FIRST_INTERVAL
        self._next_try = self._last_try = clock()   # the first try as soon as there are steps to compare

    @property
    def threads(self) -> int:
        """The count the steps run on now."""
        return self.counts[self._probe.rung if self._probe else self._rung]

    def observe(self, size: int, seconds: float) -> None:
        """A step that computed `size` tokens took `seconds` on the count in use."""
        now = self._clock()
        if self._first_step:
            self._first_step = False
            self._start_from_load(now)
        if self._probe is not None:
            self._observe_probe(size, seconds, now)
            return
        timing = self._record(self._rung, size, seconds, now)
        if len(self.counts) == 1 or timing.steps < PROBE_STEPS:
            return
        slowed = timing.mean > SLOWED * timing.best and now - self._last_try >= MIN_GAP
        if slowed and self._rung + 1 < len(self.counts):
            self._start(self._rung + 1, now)
        elif now >= self._next_try:
            more = self._rung - 1
            if more >= 0 and (free := self._free_cores(now)) is not None and free < self.counts[more]:
                self._next_try = now + FIRST_INTERVAL   # the others still hold the cores it needs: look again soon
            else:
                self._start(more if more >= 0 else self._rung + 1, now)

    def _start_from_load(self, now: float) -> None:
        """Leave the cores other processes kept busy since the governor was made to them."""
        free = self._free_cores(now)
        if free is None:
            return
        rung = next(i for i, count in enumerate(self.counts) if count <= free)
        if rung != self._rung:
            log.info("torch threads %d -> %d: other processes kept %d of %d cores busy", self.counts[self._rung],
                     self.counts[rung], self.counts[0] - free, self.counts[0])
            self._rung = rung
            self._set(self.counts[rung])

    def _free_cores(self, now: float) -> int | None:
        """The cores other processes left free since the last look (their busy time, rounded; at least one), or
        None where nothing can be read or the last look is too recent to tell."""
        then, before = self._reading
        if before is None or now - then < MIN_READING or (after := self._cpu()) is None:
            return None
        self._reading = (now, after)
        others = ((after[0] - before[0]) - (after[1] - before[1])) / (now - then)
        return max(1, self.counts[0] - int(others + 0.5))

    def _record(self, rung: int, size: int, seconds: float, now: float) -> _Timing:
        timing = self._timings.get((rung, size))
        if timing is None:
            timing = self._timings[(rung, size)] = _Timing(seconds, seconds, now)
        else:
            timing.add(seconds, now)
        return timing

    def _ratio(self, step: tuple[int, float]) -> float | None:
        """A tried step's time over the current count's recent time for steps of its size, if it has one."""
        size, seconds = step
        base = self._timings.get((self._rung, size))
        if base is None or self._clock() - base.seen > FRESH:
            return None
        return seconds / base.mean

    def _start(self, rung: int, now: float) -> None:
        self._probe = _Probe(rung)
        self._last_try = now
        self._set(self.counts[rung])

    def _observe_probe(self, size: int, seconds: float, now: float) -> None:
        probe = self._probe
        probe.times.append((size, seconds))
        ratios = [ratio for ratio in map(self._ratio, probe.times[1:]) if ratio is not None]
        # A try that is plainly losing ends at once: on a busy machine each of its steps costs several.
        if len(probe.times) < PROBE_STEPS and not (ratios and ratios[-1] > 1 / ADOPT):
            return
        for size, seconds in probe.times[1:]:
            self._record(probe.rung, size, seconds, now)
        self._probe = None
        won = len(probe.times) == PROBE_STEPS and bool(ratios) and statistics.median(ratios) <= ADOPT
        if won:
            log.info("torch threads %d -> %d: its steps took %.2fx the time", self.counts[self._rung],
                     self.counts[probe.rung], statistics.median(ratios))
            self._rung = probe.rung
            self._interval = FIRST_INTERVAL
        else:
            self._interval = min(self._interval * 2, LAST_INTERVAL)
            self._set(self.counts[self._rung])
        self._next_try = now + self._interval


class Lender:
    """Steps on one thread fewer while the app's UI thread borrows a core (core_loan.py), and back to the usual
    count (the governor's, or the user's) once it gives the core back."""

    def __init__(self, loan, set_threads: Callable[[int], None], usual: Callable[[], int]):
        self._loan = loan
        self._set = set_threads
        self._usual = usual
        self._lending = False

    def lending(self) -> bool:
        """Whether the step about to run leaves a core: checked, and the count set, before each step."""
        asked = self._loan.asked
        if asked != self._lending:
            self._lending = asked
            usual = self._usual()
            self._set(max(1, usual - 1) if asked else usual)
            self._loan.answer(asked)
        return asked


def step_threads(count: int, fixed: bool, set_threads: Callable[[int], None],
                 loan) -> tuple[ThreadGovernor | None, Lender | None]:
    """For a team of `count` threads: a governor of the count unless the user fixed it, and a lender of a core to
    the app's UI where the app shares a CoreLoan; neither for one thread."""
    if count < 2:
        return None, None
    governor = None if fixed else ThreadGovernor(count, set_threads, time.perf_counter, cpu_seconds)
    usual = (lambda: governor.threads) if governor is not None else (lambda: count)
    return governor, (Lender(loan, set_threads, usual) if loan is not None else None)
