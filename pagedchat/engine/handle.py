"""A request in flight, as its submitter sees it: a stream of deltas and, at the end, one Completion."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from pagedchat.engine.records import FinishReason
from pagedchat.engine.sequence import Completion, Sequence, StreamDelta

log = logging.getLogger("pagedchat.engine")


@dataclass(eq=False)
class RequestHandle:
    """Thread-safe: iterate it for StreamDeltas, or wait on result(). It always ends with one finished delta,
    whatever happens to the engine (an error, a shutdown)."""

    request_id: str
    prompt_token_ids: list[int]
    _cancel: Callable[[str], None]  # the engine's cancel: a handle knows no more of its engine
    on_update: Callable[[StreamDelta], None] | None = None
    _seq: Sequence | None = None  # the engine's record of the request, read for the live figures
    _deltas: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # a shutdown may end it from another thread
    _completion: Completion | None = None
    # Live figures, updated by the engine thread after each step.
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    time_to_first_token: float | None = None
    decode_tokens_per_s: float | None = None

    def cancel(self) -> None:
        self._cancel(self.request_id)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running after {timeout}s")
        return self._completion

    def __iter__(self):
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finished:
                return

    def _deliver(self, delta: StreamDelta) -> None:
        seq = self._seq
        with self._lock:
            if self._done.is_set():  # ended already (shutdown): nothing may follow the final delta
                return
            self.cached_tokens = seq.cached_tokens
            self.prefilled_tokens = seq.prefilled_tokens
            # Only the figures: a whole Completion copies every token id, on every step of every request.
            self.time_to_first_token, self.decode_tokens_per_s = seq.timing()
            if delta.finished:
                self._completion = delta.completion
            self._deltas.put(delta)
            if delta.finished:
                self._done.set()
        if self.on_update is not None:
            try:
                self.on_update(delta)
            except Exception:  # a broken listener must not stop the engine
                log.exception("on_update callback failed for %s", self.request_id)

    def _final_delta(self, reason: FinishReason | None = None, error: str | None = None) -> StreamDelta:
        """A final delta with what the request has so far, ending it with reason (default: the reason the
        engine gave it). Built under the engine's lock, so that the sequence does not move meanwhile."""
        seq = self._seq
        completion = seq.completion()
        if reason is not None:
            completion = dataclasses.replace(completion, finish_reason=reason, error=error)
        return StreamDelta(self.request_id, [], seq.text[seq.emitted:], finished=True, completion=completion)
