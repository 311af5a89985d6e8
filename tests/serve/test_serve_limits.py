"""serve/limits.py's parts on their own: the default body limit and the loop error handler that logs once."""

from __future__ import annotations

import logging

from pagedchat.serve.limits import MIN_BODY_BYTES, REPEAT_LOG_SECONDS, LogOnce, default_body_limit


class Loop:
    """The part of an event loop LogOnce calls: asyncio's own handler, recorded."""

    def __init__(self):
        self.defaults: list[dict] = []

    def default_exception_handler(self, context: dict) -> None:
        self.defaults.append(context)


def test_the_default_body_limit_follows_the_context_above_a_floor():
    assert default_body_limit(2048) == MIN_BODY_BYTES
    assert default_body_limit(128 * 1024) == 32 * 128 * 1024


def test_a_repeated_loop_error_is_logged_once_then_counted_once_a_minute(caplog):
    now = [0.0]
    handler, loop = LogOnce(clock=lambda: now[0]), Loop()
    accept = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    other = {"message": "Task exception was never retrieved"}
    for second in range(150):   # asyncio retries accept() every second
        now[0] = float(second)
        handler(loop, accept)
    handler(loop, other)
    assert [c["message"] for c in loop.defaults] == [accept["message"], other["message"]]
    counts = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert counts == [f"{accept['message']}: {int(REPEAT_LOG_SECONDS)} more times since it was last logged"] * 2
