"""The server's grammar compiles: on a thread of their own, each within a deadline."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

from pagedchat.backends.base import TokenBackend
from pagedchat.engine.structured import CompiledGrammar, GrammarSpec
from pagedchat.errors import RequestError

# How long a request waits for its grammar (in the queue and compiling). llguidance's own limits bound a mask
# step but not a compile, whose cost can grow with the square of a schema's optional properties.
COMPILE_SECONDS = 10.0


class GrammarWorker:
    """Compiles grammars one at a time on one thread: a slow schema never holds up the tokenizing of other
    prompts, and compiles never take more than one core from the engine. A request whose grammar misses the
    deadline is refused; llguidance cannot be stopped mid-compile, so that compile runs on to its end (and its
    grammar is cached), while the compiles queued behind it keep their own deadlines. The thread is a daemon:
    a server that stops does not wait for a compile."""

    def __init__(self, deadline_s: float = COMPILE_SECONDS):
        self.deadline_s = deadline_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pagedchat-grammar", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, backend, spec = job
            if future.set_running_or_notify_cancel():   # False: its request gave up while it was queued
                try:
                    future.set_result(backend.compile_grammar(spec))
                except BaseException as exc:
                    future.set_exception(exc)

    async def compile(self, backend: TokenBackend, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, or RequestError: the grammar's own, or the deadline's."""
        future: Future = Future()
        self._jobs.put((future, backend, spec))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.deadline_s)
        except asyncio.TimeoutError:   # a job still queued is dropped with it; a running one runs on
            raise RequestError(f"the {spec.kind.value} did not compile within {self.deadline_s:g} s "
                               "(pagedchat serve --grammar-timeout): make it smaller, with fewer optional "
                               "properties or alternatives") from None

    def shutdown(self) -> None:
        self._jobs.put(None)
