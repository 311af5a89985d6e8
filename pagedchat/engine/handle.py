"""A request in flight, as its submitter sees it: a stream of Updates and, at the end, one Outcome."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.engine.sequence import Sequence

log = logging.getLogger("pagedchat.engine")


@dataclass(eq=False)
class RequestHandle:
    """The engine's ReplyHandle (engine/records.py). Thread-safe: iterate it for Updates, or wait on result().
    It always ends with one finished update, whatever happens to the engine (an error, a shutdown)."""

    request_id: str
    prompt_token_ids: list[int]
    _cancel: Callable[[str], None]  # the engine's cancel: a handle knows no more of its engine
    on_update: Callable[[Update], None] | None = None
    _seq: Sequence | None = None  # the engine's record of the request, read for the live figures
    _updates: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # a shutdown may end it from another thread
    _outcome: Outcome | None = None
    _figures: Outcome | None = None  # so far, as of the engine's last step

    def cancel(self) -> None:
        self._cancel(self.request_id)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def so_far(self) -> Outcome:
        with self._lock:
            return self._outcome or self._figures or Outcome(self.request_id,
                                                             prompt_tokens=len(self.prompt_token_ids))

    def result(self, timeout: float | None = None) -> Outcome:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running after {timeout}s")
        return self._outcome

    def __iter__(self):
        while True:
            update = self._updates.get()
            yield update
            if update.finished:
                return

    def _deliver(self, update: Update) -> None:
        with self._lock:
            if self._done.is_set():  # ended already (shutdown): nothing may follow the final update
                return
            self._figures = self._seq.figures()
            if update.finished:
                self._outcome = update.outcome
            self._updates.put(update)
            if update.finished:
                self._done.set()
        if self.on_update is not None:
            try:
                self.on_update(update)
            except Exception:  # a broken listener must not stop the engine
                log.exception("on_update callback failed for %s", self.request_id)

    def _final_update(self, text: tuple[str, str], reason: FinishReason | None = None,
                      error: str | None = None) -> Update:
        """A final update with what the request has so far (text: the detokenizer's finish(), what is left to
        stream and the whole), ending it with reason (default: the reason the engine gave it). Built under the
        engine's lock, so that the sequence does not move meanwhile."""
        seq = self._seq
        rest, whole = text
        outcome = seq.outcome(whole)
        if reason is not None:
            outcome = dataclasses.replace(outcome, finish_reason=reason, error=error)
        return seq.update(rest, outcome=outcome)
