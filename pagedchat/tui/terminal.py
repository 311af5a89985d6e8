"""How the app meets its terminal's end: the signals that save the chats and exit, and Textual's terminal
driver, made to outlive its terminal.

When the terminal closes (its window shut, an ssh link dropped) the kernel hangs it up: the app gets SIGHUP,
saves every chat and exits (app.py), but from then on each write to the terminal fails. Textual's output thread
dies at the first such write; its queue is bounded, so once enough screen updates have queued up behind it the
next one blocks the app's loop for good, and the exit never ends. Whether it does depends on how many updates
come between the hang-up and the exit: a busy machine made the app hang now and then. Here a write that fails
drops the output instead, so the thread keeps emptying its queue.
"""

from __future__ import annotations

import asyncio
import signal
from typing import IO, Callable

from textual.driver import Driver

try:
    from textual.drivers.linux_driver import LinuxDriver
except ImportError:   # no termios (Windows): Textual's own driver there
    LinuxDriver = None

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)


def install_exit_signals(handler: Callable[[], None]) -> None:
    """handler, on the app's loop, for SIGTERM and SIGHUP (the terminal closed)."""
    try:
        loop = asyncio.get_running_loop()
        for sig in EXIT_SIGNALS:
            loop.add_signal_handler(sig, handler)
    except (NotImplementedError, RuntimeError, ValueError):  # no signals here, or not the main thread
        pass


def remove_exit_signals() -> None:
    try:
        loop = asyncio.get_running_loop()
        for sig in EXIT_SIGNALS:
            loop.remove_signal_handler(sig)
    except (NotImplementedError, RuntimeError, ValueError):
        pass


class TerminalOutput:
    """The file the output thread writes through. A write that fails means the terminal is gone (a terminal
    write blocks rather than fail for want of room), so nothing more is written."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file
        self.gone = False

    def write(self, text: str) -> None:
        self._attempt(self._file.write, text)

    def flush(self) -> None:
        self._attempt(self._file.flush)

    def _attempt(self, call, *args) -> None:
        if self.gone:
            return
        try:
            call(*args)
        except OSError:
            self.gone = True

    def fileno(self) -> int:
        return self._file.fileno()


if LinuxDriver is not None:
    class TerminalDriver(LinuxDriver):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._file = TerminalOutput(self._file)


def terminal_driver(chosen: type[Driver]) -> type[Driver]:
    """Ours in place of Textual's terminal driver; any other (one named in TEXTUAL_DRIVER, say) as it is."""
    return TerminalDriver if LinuxDriver is not None and chosen is LinuxDriver else chosen
