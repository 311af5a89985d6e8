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
    _streamed: tuple[int, int] = (0, 0)  # characters and tokens its updates have carried so far

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
            if not self._put(update):
                return
        self._notify(update)

    def _end(self, final: Update) -> None:
        """End the request with final (a shutdown's or a failed loop's), its text and tokens all those of the
        outcome that no update has carried yet. A step hands its updates over after it lets go of the engine's
        lock, so this may come between: that step's update is then dropped, and its text comes here instead."""
        with self._lock:
            chars, tokens = self._streamed
            outcome = final.outcome
            final = dataclasses.replace(final, text=outcome.text[chars:], tokens=len(outcome.token_ids) - tokens,
                                        token_ids=tuple(outcome.token_ids[tokens:]))
            if not self._put(final):
                return
        self._notify(final)

    def _put(self, update: Update) -> bool:
        """Queue update (the handle's lock held); False once the request has ended: nothing follows the final."""
        if self._done.is_set():
            return False
        self._figures = self._seq.figures()
        self._streamed = (self._streamed[0] + len(update.text), self._streamed[1] + update.tokens)
        if update.finished:
            self._outcome = update.outcome
        self._updates.put(update)
        if update.finished:
            self._done.set()
        return True

    def _notify(self, update: Update) -> None:
        if self.on_update is not None:
            try:
                self.on_update(update)
            except Exception:  # a broken listener must not stop the engine
                log.exception("on_update callback failed for %s", self.request_id)

    def _final_update(self, whole: str, reason: FinishReason | None = None, error: str | None = None) -> Update:
        """A final update with what the request has so far (whole: its reply's text), ending it with reason
        (default: the reason the engine gave it); _end gives it the text and tokens not yet streamed. Built under
        the engine's lock, so that the sequence does not move meanwhile."""
        seq = self._seq
        outcome = seq.outcome(whole)
        if reason is not None:
            outcome = dataclasses.replace(outcome, finish_reason=reason, error=error)
        return seq.update("", outcome=outcome)
