"""The bench's progress bar, and running each runner on a thread of its own."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def set_total(self, total: int) -> None: ...
    def describe(self, text: str) -> None: ...
    def advance(self, n: int = 1) -> None: ...


class ProgressBar:
    """A rich progress bar on stderr; `advance(n)` and `describe(text)` are safe from the engine thread."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:<42}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens"), TimeElapsedColumn(), console=console, transient=True)
        self.task = None

    def __enter__(self):
        self.progress.start()
        self.task = self.progress.add_task("starting", total=None)
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def set_total(self, total: int) -> None:
        self.progress.update(self.task, total=total)

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)


class NoProgress:
    def set_total(self, total: int) -> None: ...
    def describe(self, text: str) -> None: ...
    def advance(self, n: int = 1) -> None: ...


def on_own_thread(fn, *args):
    """Run fn on a thread that ends with it, as the engine runs on its own: each runner then computes with the
    only OpenMP team alive in the process (see pagedchat/engine/compute_thread.py)."""
    from pagedchat.engine.compute_thread import ComputeThread

    worker = ComputeThread("pagedchat-bench-peer")
    try:
        return worker.call(fn, *args)
    finally:
        worker.close()
