"""The thread governor against a simulated machine: each count's step time is given, the clock is the steps'."""

from __future__ import annotations

import time

import pytest

from pagedchat.engine.threads import LAST_INTERVAL, ThreadGovernor, cpu_seconds, ladder


class Machine:
    """Steps whose time depends on the thread count in use: `costs[threads]` seconds a step. `others` cores are
    kept busy by other processes, which the CPU reading shows (None: a machine without /proc)."""

    def __init__(self, costs: dict[int, float], others: float | None = None):
        self.costs = costs
        self.now = 0.0
        self.others = others
        self.busy = self.ours = 0.0
        self.counts_set: list[int] = []
        self.governor = ThreadGovernor(max(costs), self.counts_set.append, lambda: self.now, self.cpu)

    def cpu(self) -> tuple[float, float] | None:
        """Every process's busy seconds and ours (a core's worth while it runs; the others' as set)."""
        return None if self.others is None else (self.busy, self.ours)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.ours += seconds
        self.busy += seconds * (1 + (self.others or 0.0))

    def run(self, seconds: float, size: int = 1) -> dict[int, float]:
        """Step for about `seconds`; the share of the time each count ran."""
        spent: dict[int, float] = {}
        end = self.now + seconds
        while self.now < end:
            threads = self.governor.threads
            cost = self.costs[threads]
            self.advance(cost)
            spent[threads] = spent.get(threads, 0.0) + cost
            self.governor.observe(size, cost)
        return {t: s / seconds for t, s in spent.items()}


def test_ladder_tries_every_core_one_fewer_and_halves():
    assert ladder(1) == (1,)
    assert ladder(2) == (2, 1)
    assert ladder(16) == (16, 15, 8, 4, 2, 1)


def test_a_quiet_machine_keeps_every_core_and_tries_fewer_ever_more_rarely():
    machine = Machine({2: 0.010, 1: 0.018})
    share = machine.run(120.0)
    assert machine.governor.threads == 2
    assert share[2] > 0.995
    # A try runs a few steps: with the interval doubling to its cap, a couple of minutes hold a handful of tries.
    tries = machine.counts_set.count(1)
    assert 3 <= tries <= 4 + 120 / LAST_INTERVAL


def test_a_busy_machine_moves_to_one_thread_at_once():
    machine = Machine({2: 0.100, 1: 0.020})   # a core taken: every barrier waits out a time slice
    machine.run(0.5)
    assert machine.governor.threads == 1
    share = machine.run(10.0)
    assert machine.governor.threads == 1
    assert share[1] > 0.9


@pytest.mark.parametrize("others, first", [(0.0, 2), (0.3, 2), (0.9, 1), (1.6, 1)])
def test_the_first_count_leaves_the_cores_other_processes_keep_busy(others, first):
    machine = Machine({2: 0.100, 1: 0.020} if first == 1 else {2: 0.010, 1: 0.018}, others=others)
    machine.advance(0.5)                     # the model loads, and the others run meanwhile
    machine.run(0.02)                        # the first step reads what they took
    assert machine.governor.threads == first and machine.counts_set[:1] == ([1] if first == 1 else [])


def test_no_try_of_more_threads_while_the_others_hold_the_cores_and_one_when_they_leave():
    machine = Machine({2: 0.100, 1: 0.020}, others=1.0)
    machine.advance(0.5)
    machine.run(60.0)
    assert machine.counts_set == [1]          # moved at the first step, and never tried two threads since
    machine.others, machine.costs = 0.0, {2: 0.010, 1: 0.018}
    machine.run(3.0)
    assert machine.governor.threads == 2


def test_without_a_cpu_reading_the_steps_alone_decide():
    machine = Machine({2: 0.100, 1: 0.020}, others=None)
    machine.advance(0.5)
    machine.run(0.1)
    assert machine.governor.threads == 2     # not yet: its tries need steps to compare
    machine.run(0.5)
    assert machine.governor.threads == 1


def test_a_machine_that_gets_busy_moves_down_and_back_when_it_is_quiet_again():
    machine = Machine({2: 0.010, 1: 0.018})
    machine.run(5.0)
    assert machine.governor.threads == 2
    machine.costs = {2: 0.090, 1: 0.020}      # another process takes a core
    machine.run(1.0)
    assert machine.governor.threads == 1
    busy = machine.run(60.0)
    assert busy[1] > 0.9                      # trying two threads again now and then costs little
    machine.costs = {2: 0.010, 1: 0.018}      # it ends
    machine.run(LAST_INTERVAL + 1.0)
    assert machine.governor.threads == 2


def test_a_count_is_compared_only_on_steps_of_the_same_size():
    machine = Machine({2: 0.010, 1: 0.018})
    machine.run(3.0, size=1)
    # A try that meets only steps of another size has nothing to compare, so nothing changes.
    machine.costs = {2: 0.500, 1: 0.018}
    machine.run(0.05, size=512)
    assert machine.governor.threads in (1, 2)
    machine.costs = {2: 0.010, 1: 0.018}
    machine.run(30.0, size=1)
    assert machine.governor.threads == 2


@pytest.mark.parametrize("noise", [0.05, 0.10])
def test_noise_alone_never_settles_on_the_slower_count(noise):
    import random

    rng = random.Random(0)
    machine = Machine({2: 0.010, 1: 0.018})
    base = dict(machine.costs)
    for _ in range(2000):
        machine.costs = {t: c * (1 + rng.uniform(-noise, noise)) for t, c in base.items()}
        machine.run(0.01)
    assert machine.governor.threads == 2


def test_the_cpu_reading_counts_this_process_within_every_process():
    reading = cpu_seconds()
    if reading is None:
        pytest.skip("no /proc here")
    before = reading
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = cpu_seconds()
    assert after[1] - before[1] >= 0.15           # our own busy loop
    assert after[0] - before[0] >= after[1] - before[1] - 0.02   # within what every process used
