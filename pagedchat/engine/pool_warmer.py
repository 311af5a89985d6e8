"""The KV pool's next pages faulted in while the engine waits, rather than by the step that first writes them.

The pool is lazily zeroed memory in huge pages (engine/model_runner.py's zeros): the first write into a page
faults in and zeroes 2 MiB of every layer's region at once, in the middle of a step. A new engine's first reply
did it for every layer (docs/bench.md#the-first-reply). Pages are handed out from the lowest free index up
(engine/page_pool.py), so the pages just past the highest one written are the next to be written: the engine
faults those in when it has nothing else to do, a region at a time, on its own thread (engine.py's loop), so a
request that comes in waits for one region at most. Faulting in keeps the contents (hugepages.populate).
"""

from __future__ import annotations

import math

import torch

from pagedchat.model import hugepages


class PoolWarmer:
    """One layer group's pool, [layers, 2, pages, ...] on the CPU, kept faulted in a huge page's worth of pages
    past the highest page written, in each region (a layer's keys or its values)."""

    def __init__(self, pool: torch.Tensor):
        self.regions = [pool[layer, part].data_ptr() for layer in range(pool.shape[0]) for part in range(2)]
        self.num_pages = pool.shape[2]
        self.page_bytes = pool.element_size() * math.prod(pool.shape[3:])
        self.ahead = max(1, hugepages.HUGE_PAGE // self.page_bytes)
        self.warmed = 0                    # pages [0, warmed) are faulted in, in every region
        self.wanted = min(self.num_pages, self.ahead)
        self.supported = True
        self._region = 0                   # the next region of the round that warms [warmed, _end)
        self._end = 0

    def written(self, page: int) -> None:
        """A step writes page: the pages past it are wanted next."""
        self.wanted = max(self.wanted, min(self.num_pages, page + 1 + self.ahead))

    def warm_some(self) -> bool:
        """Fault one region's next pages in. False when there is nothing to do (or the OS cannot)."""
        if not self.supported or (self._region == 0 and self.warmed >= self.wanted):
            return False
        if self._region == 0:
            self._end = min(self.wanted, self.warmed + self.ahead)
        start = self.regions[self._region] + self.warmed * self.page_bytes
        if not hugepages.populate(start, (self._end - self.warmed) * self.page_bytes):
            self.supported = False  # steps fault their pages in themselves, as without the warmer
            return False
        self._region = (self._region + 1) % len(self.regions)
        if self._region == 0:
            self.warmed = self._end
        return True
