"""A core the app's UI thread borrows from the engine for a screen update.

Where every core runs one of the engine's threads, a screen update preempts one of them, and the other then waits
at the next barrier of the step's parallel loops: the engine loses about twice the time the UI takes. So the app
asks first. It writes a deadline on a page it shares with the engine's process, waits a few milliseconds at most
for the engine to answer, and renders while the engine's steps run on one thread fewer (threads.Lender). It
asks with a deadline rather than a flag, so that an app that stops in mid-loan holds the core that long at most.

The page: the deadline, time.monotonic() as a float64 at 0 (one clock for every process on Linux and macOS);
the engine's answer, a byte at 8: 1 while its steps leave a core. Torch-free.
"""

from __future__ import annotations

import mmap
import struct
import tempfile
import time

HOLD_S = 0.25   # a loan not given back ends by itself this long after it was asked for
_DEADLINE = struct.Struct("d")
_ANSWER = _DEADLINE.size


class CoreLoan:
    """Both sides of the page: the app asks and gives back; the engine reads the ask and answers."""

    def __init__(self, fd: int) -> None:
        """fd: the page's file, mapped here (the caller may close it afterwards)."""
        self._page = mmap.mmap(fd, mmap.PAGESIZE)

    @classmethod
    def create(cls):
        """A new page, and its open file, whose descriptor the engine's process inherits (close it once the
        process has started)."""
        file = tempfile.TemporaryFile()
        file.truncate(mmap.PAGESIZE)
        return cls(file.fileno()), file

    # The app's side.
    def ask(self, hold_s: float = HOLD_S) -> None:
        _DEADLINE.pack_into(self._page, 0, time.monotonic() + hold_s)

    def give_back(self) -> None:
        _DEADLINE.pack_into(self._page, 0, 0.0)

    @property
    def lent(self) -> bool:
        """The engine has answered: its steps leave a core."""
        return self._page[_ANSWER] == 1

    # The engine's side.
    @property
    def asked(self) -> bool:
        return _DEADLINE.unpack_from(self._page, 0)[0] > time.monotonic()

    def answer(self, lent: bool) -> None:
        self._page[_ANSWER] = int(lent)
