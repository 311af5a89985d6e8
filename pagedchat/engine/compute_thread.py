"""The one thread on which an engine runs torch: weight loading, cache allocation and every step.

Why one thread: torch's CPU ops run on OpenMP (libgomp), which gives each thread that calls into it a team of
worker threads of its own. Two live teams oversubscribe a small machine's cores, and libgomp then stops letting
idle workers spin, so every parallel op pays a sleep/wake-up: stepping on a thread other than the one that
loaded the weights slows every decode step, and loading and stepping on one thread costs nothing extra (the
figures: docs/bench.md#one-compute-thread). Callers' threads then stay free of torch work, so an app's or
a benchmark's own thread holds no team.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

_STOP = object()
log = logging.getLogger("pagedchat.engine")


class ComputeThread:
    def __init__(self, name: str, threads: int | None = None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = threads
        # A daemon: an engine nobody shut down must not keep the interpreter from exiting.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the thread and wait for its result (its exception is raised here)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future.result()

    def start(self, fn: Callable[[], None]) -> None:
        """Run fn on the thread without waiting: the engine's loop, which returns when the engine stops."""
        self._jobs.put((fn, (), None))

    def close(self, timeout: float = 10.0) -> None:
        """End the thread once the job it runs returns (its OpenMP team goes with it)."""
        self._jobs.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _serve(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)  # OpenMP's thread count is per calling thread: set it here
        while (job := self._jobs.get()) is not _STOP:
            self._run(*job)
            # Not held while the thread waits: the callable may be an engine's bound method, which would keep the
            # engine alive, and its finalizer is what closes an engine dropped without shutdown().
            del job

    def _run(self, fn: Callable[..., Any], args: tuple, future: Future | None) -> None:
        if future is None:
            try:
                fn(*args)
            except BaseException:  # the engine's loop ends its own requests; never die without a word
                log.exception("job on %s failed", self._thread.name)
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the waiting caller, who raises it
            future.set_exception(exc)
