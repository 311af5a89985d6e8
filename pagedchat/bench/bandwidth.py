"""The machine's memory read bandwidth, the ceiling of one chat's decode: each token reads every weight once, so
weights' bytes x tokens/s over this is the share of it a runner reaches. Measured in memory advised for huge pages,
as pagedchat's weights are (model/hugepages.py), and in torch's own allocation: where Linux gives huge pages only
on request, the two differ by a quarter (docs/bench.md#at-the-sizes-people-run-a-1b-shaped-q4_k_m)."""

from __future__ import annotations

import mmap
import os
import threading
import time

READ_MIB = 1024  # past the caches: this Xeon VM reports a 480 MiB L3
TRIES = 5


def read_bandwidths() -> tuple[float, float | None]:
    """(from memory advised for huge pages, from torch's own allocation); the second None where the OS takes no
    such advice (the two would be one)."""
    huge = read_bandwidth(huge_pages=True)
    return huge, read_bandwidth(huge_pages=False) if hasattr(mmap, "MADV_HUGEPAGE") else None


def read_bandwidth(huge_pages: bool, mib: int = READ_MIB, tries: int = TRIES) -> float:
    """Bytes a second a torch.sum of mib MiB of float32 reads on every core, best of tries, from memory advised
    for huge pages or from torch's own. Run on a thread of its own that ends with it, so that its OpenMP team does
    not outlive the measurement beside the engine's."""
    import torch

    from pagedchat.model import hugepages

    best: list[float] = []

    def measure() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            nbytes = mib * 2**20
            x = hugepages.anonymous(nbytes).view(torch.float32) if huge_pages else torch.empty(nbytes // 4)
            x.fill_(1.0)
            x.sum()  # the team started before the clock
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
