"""Memory in Linux's transparent huge pages (2 MiB), for what a decode step streams: the KV pool and the weights.

One chat's decode reads every weight once a token, and memory reads faster from huge pages than from 4 KiB ones
(fewer TLB misses; the hardware prefetchers stop at every page's end): docs/memory.md#huge-pages. Where the
kernel's `transparent_hugepage` setting is `madvise`, as on many distributions, memory must ask for them.
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import struct
import sys
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # smaller tensors stay in torch's allocations: a mapping each would waste its last page
SMALL_PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; Python's mmap module does not name it
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool}


def anonymous(nbytes: int) -> torch.Tensor:
    """nbytes of zeros as a uint8 tensor, from the OS's lazily zeroed memory (a page is handed out at its first
    touch), asked for in huge pages where the OS has them."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes == 0:  # not Linux; an empty map cannot be made
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # MAP_SHARED would be shmem, not anonymous THP
    try:
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
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata, read into memory: each tensor of a huge page or more into a
    mapping of its own asked for in huge pages (so each is freed on its own), the rest into torch's memory.
    Read, not mapped: a file's mapping sits in 4 KiB pages, and copying out of it would hold both for a while.
    A cut-off or foreign file raises (ValueError, or the header's own JSON, struct or key errors)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        meta = header.pop("__metadata__", None) or {}
        tensors = {}
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            start, end = entry["data_offsets"]
            nbytes = end - start
            data = anonymous(nbytes) if nbytes >= HUGE_PAGE else torch.empty(nbytes, dtype=torch.uint8)
            f.seek(8 + size + start)
            _read_into(f, data.numpy(), name)
            tensors[name] = data.view(_DTYPES[entry["dtype"]]).view(entry["shape"])
    return tensors, meta


def _read_into(f, out: np.ndarray, name: str) -> None:
    """Fill out from f, in pieces: one read() returns at most about 2 GiB on Linux."""
    view = memoryview(out)
    done = 0
    while done < len(view):
        got = f.readinto(view[done:done + (1 << 28)])
        if not got:
            raise ValueError(f"the file ends inside tensor {name}")
        done += got
