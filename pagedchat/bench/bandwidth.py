"""The machine's memory read bandwidth, the ceiling of one chat's decode: each token reads every weight once, so
weights' bytes x tokens/s over this is the share of it a runner reaches."""

from __future__ import annotations

import os
import threading
import time

READ_MIB = 1024  # past the caches: this Xeon VM reports a 480 MiB L3
TRIES = 5


def read_bandwidth(mib: int = READ_MIB, tries: int = TRIES) -> float:
    """Bytes a second a torch.sum of mib MiB of float32 reads on every core, best of tries. Run on a thread of
    its own that ends with it, so that its OpenMP team does not outlive the measurement beside the engine's."""
    import torch

    best: list[float] = []

    def measure() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            x = torch.ones(mib * 2**20 // 4)
            x.sum()  # pages touched and the team started before the clock
            times = []
            for _ in range(tries):
                start = time.perf_counter()
                x.sum()
                times.append(time.perf_counter() - start)
            best.append(x.numel() * 4 / min(times))
        finally:
            torch.set_num_threads(before)

    thread = threading.Thread(target=measure, name="pagedchat-bandwidth")
    thread.start()
    thread.join()
    return best[0]


def share(weight_bytes: int, tokens_per_s: float | None, bandwidth: float | None) -> float | None:
    """The share of the bandwidth a decode at tokens_per_s reaches, reading weight_bytes a token."""
    if not tokens_per_s or not bandwidth:
        return None
    return weight_bytes * tokens_per_s / bandwidth
