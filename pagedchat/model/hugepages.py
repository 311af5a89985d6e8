"""Memory in Linux's transparent huge pages (2 MiB), for what a decode step streams: the KV pool and the weights.

One chat's decode reads every weight once a token, and memory reads faster from huge pages than from 4 KiB ones
(fewer TLB misses; the hardware prefetchers stop at every page's end): docs/memory.md#huge-pages. Where the
kernel's `transparent_hugepage` setting is `madvise`, as on many distributions, memory must ask for them.

Huge pages cost more to hand out than small ones, and much more on some VMs, where the host backs every fresh 2 MiB
block again (docs/bench.md#start-up-weights-into-huge-pages-while-idle). So where the kernel can turn small pages
into huge ones on request (MADV_COLLAPSE, Linux 6.1 and later), the weights are read into small pages, which is
quick, and turned into huge ones while the engine is idle (Collapser); elsewhere they are read into huge pages.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import mmap
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # smaller tensors stay in torch's allocations: a mapping each would waste its last page
SMALL_PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; Python's mmap module does not name it
MADV_COLLAPSE = 25  # Linux 6.1 and later; nor this one
THP_SWITCH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
COLLAPSE_STEP = 8 * HUGE_PAGE  # one idle turn's share: a request that comes in waits for this much at most
COLLAPSE_TRIES = 3  # transient refusals in a row (a page locked or in flight) before the kernel's thread takes over
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool}


def anonymous(nbytes: int, huge: bool = True) -> torch.Tensor:
    """nbytes of zeros as a uint8 tensor, from the OS's lazily zeroed memory (a page is handed out at its first
    touch), asked for in huge pages where the OS has them (and huge)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes == 0:  # not Linux; an empty map cannot be made
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # MAP_SHARED would be shmem, not anonymous THP
    try:
        if huge:
            memory.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages: small pages serve
        pass
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the map


def populate(address: int, nbytes: int) -> bool:
    """Fault [address, address + nbytes) of anonymous memory in for writing, contents kept (MADV_POPULATE_WRITE):
    the zeroing of a page's first touch paid now, by the caller, rather than by whoever writes there first. False
    where the OS cannot (not Linux, or older than 5.14)."""
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    start = address - address % SMALL_PAGE
    end = -(-(address + nbytes) // SMALL_PAGE) * SMALL_PAGE
    return _libc().madvise(start, end - start, MADV_POPULATE_WRITE) == 0


@functools.cache
def can_collapse() -> bool:
    """Whether this kernel turns a range's small pages into huge ones on request (MADV_COLLAPSE): asked once,
    of a scratch mapping. Not where huge pages are switched off: the collapse would ignore that setting."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or _switched_off():
        return False
    scratch = anonymous(2 * HUGE_PAGE, huge=False)
    scratch.fill_(1)
    start, _ = _whole_huge_pages(scratch)
    return _collapse(start, HUGE_PAGE) == 0


def _whole_huge_pages(t: torch.Tensor) -> tuple[int, int]:
    """The addresses of the whole huge pages t's bytes cover: from its first 2 MiB boundary to its last (an empty
    range where there is none)."""
    first = t.data_ptr()
    return -(-first // HUGE_PAGE) * HUGE_PAGE, (first + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE


def _switched_off() -> bool:
    try:
        return "[never]" in THP_SWITCH.read_text()
    except OSError:  # no such setting: a kernel without transparent huge pages, which the probe finds out
        return False


class Collapser:
    """Tensors read into small pages, turned into huge ones a step at a time (MADV_COLLAPSE keeps the contents
    and the addresses) by whoever has time: the engine's loop while no request waits (engine.py), a huge page
    before each step of an engine that is never idle (model_runner.py), or one that wants them now (the bench).
    Each tensor's whole huge pages are collapsed; the bytes before its first boundary and after its last stay
    small, as they would in a mapping advised for huge pages. Safe from several threads."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._ranges: list[tuple[torch.Tensor, int, int]] = []  # (tensor, start, end) left, the tensor kept alive
        for t in tensors:
            start, end = _whole_huge_pages(t)
            if end > start:
                self._ranges.append((t, start, end))
        self._lock = threading.Lock()
        self._refused = 0  # transient refusals in a row

    def collapse_some(self, nbytes: int = COLLAPSE_STEP) -> bool:
        """Collapse the next nbytes (whole huge pages). False when nothing is left. A transient refusal (EAGAIN)
        leaves the range for the next call, a few times in a row; where the kernel cannot (no huge page free,
        say), the rest is advised for huge pages instead, for the kernel's own collapsing thread."""
        with self._lock:
            if not self._ranges:
                return False
            t, start, end = self._ranges[0]
            stop = min(end, start + max(HUGE_PAGE, nbytes // HUGE_PAGE * HUGE_PAGE))
            if stop < end:
                self._ranges[0] = (t, stop, end)
            else:
                self._ranges.pop(0)
        refusal = _collapse(start, stop - start)
        with self._lock:
            self._refused = self._refused + 1 if refusal else 0
            if refusal == 0:
                return True
            if refusal == errno.EAGAIN and self._refused < COLLAPSE_TRIES:
                self._ranges.insert(0, (t, start, stop))
                return True
            rest, self._ranges = [(t, start, stop), *self._ranges], []
        for _, a, b in rest:
            _libc().madvise(a, b - a, mmap.MADV_HUGEPAGE)
        return False

    def finish(self) -> None:
        """Collapse whatever is left, now."""
        while self.collapse_some():
            pass


def _collapse(start: int, nbytes: int) -> int:
    """MADV_COLLAPSE over [start, start + nbytes): 0, or the errno the kernel refused it with."""
    return 0 if _libc().madvise(start, nbytes, MADV_COLLAPSE) == 0 else ctypes.get_errno()


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], Collapser | None]:
    """A safetensors file's tensors and metadata, read into memory: each tensor of a huge page or more into a
    mapping of its own (so each is freed on its own), the rest into torch's memory. The mappings are asked for
    in huge pages, or, where the kernel can collapse small pages later, read into small ones and returned with
    the Collapser that will. Read, not mapped: a file's mapping sits in 4 KiB pages, and copying out of it would
    hold both for a while. A cut-off or foreign file raises (ValueError, or the header's own JSON, struct or key
    errors)."""
    later = can_collapse()
    large = []
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        meta = header.pop("__metadata__", None) or {}
        tensors = {}
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            start, end = entry["data_offsets"]
            nbytes = end - start
            if nbytes >= HUGE_PAGE:
                data = anonymous(nbytes, huge=not later)
                if later:  # the small pages faulted in at once, not one fault per page inside read()
                    populate(data.data_ptr(), nbytes)
                large.append(data)
            else:
                data = torch.empty(nbytes, dtype=torch.uint8)
            f.seek(8 + size + start)
            _read_into(f, data.numpy(), name)
            tensors[name] = data.view(_DTYPES[entry["dtype"]]).view(entry["shape"])
    return tensors, meta, Collapser(large) if later else None


def _read_into(f, out: np.ndarray, name: str) -> None:
    """Fill out from f, in pieces: one read() returns at most about 2 GiB on Linux."""
    view = memoryview(out)
    done = 0
    while done < len(view):
        got = f.readinto(view[done:done + (1 << 28)])
        if not got:
            raise ValueError(f"the file ends inside tensor {name}")
        done += got
