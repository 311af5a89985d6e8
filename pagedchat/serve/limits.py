"""What bounds a client's cost to the server before any route runs: the body size, the time to send a request's
headers, the requests one client may have open at once, and how often one repeated loop error is logged."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedchat.serve.protocol import ApiError

log = logging.getLogger("pagedchat.serve")

# The default body limit, per token of the model's context: a token of text is about 4 bytes, and JSON escapes
# can make a character 6 (\uXXXX) or 12 (a surrogate pair); the floor leaves room for small-context models.
BODY_BYTES_PER_TOKEN = 32
MIN_BODY_BYTES = 1 << 20
# A loop error seen again is counted, and the count logged at most this often.
REPEAT_LOG_SECONDS = 60.0


def default_body_limit(context_length: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context_length)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size} bytes, over this server's limit of {limit} "
                         "(pagedchat serve --max-body-size)", code="body_too_large")


class BodyLimit:
    """ASGI middleware: a body over the limit gets 413 before anything parses it: at once when its
    Content-Length says so, else as soon as the bytes read pass the limit (a chunked body has no length).
    limit() is read per request: the default follows the model's context, known once it has loaded."""

    def __init__(self, app, limit: Callable[[], int]):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > limit:  # h11 has already refused a malformed length
            error = _too_large(length.decode(), limit)
            await JSONResponse(error.body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # raised inside the route's body read: its error handler answers 413
                    raise _too_large(f"over {received}", limit)
            return message

        await self.app(scope, counted, send)


def client_of(scope) -> str:
    """Who sent a request, for per-client limits: its API key where the server has keys (BearerAuth has checked
    it by then), else its address."""
    scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return "key:" + token.strip().decode("latin-1")
    client = scope.get("client")
    return "address:" + (client[0] if client else "unknown")


class PerClientLimit:
    """ASGI middleware: each client (an API key, else an address) may have `most` generation requests open at
    once; one more is answered 429 with Retry-After, before its body is read, and the others' replies go on.
    A request counts until its whole response is sent, a stream's last event included."""

    PATHS = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app, most: int):
        self.app = app
        self.most = most
        self.open: dict[str, int] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        client = client_of(scope)
        if self.open.get(client, 0) >= self.most:
            held = f"{self.most} request{'s' if self.most > 1 else ''}"
            error = ApiError(429, f"this client already has {held} open, the most this server allows one client "
                                  "(pagedchat serve --max-requests-per-key); retry when one finishes",
                             code="rate_limit_exceeded", kind="requests")
            await JSONResponse(error.body(), status_code=429, headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.open[client] = self.open.get(client, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.open.pop(client) - 1
            if left:
                self.open[client] = left


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request's headers.

    uvicorn arms its keep-alive timer only after a response, and disarms it on any byte received: a socket that
    connects and sends nothing, or a byte now and then, holds a file descriptor forever. Here a connection gets
    timeout_keep_alive seconds, from its start or its last response, to send a whole request head."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and not self._waiting():  # a request's head arrived
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        if self._waiting() and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._waiting():
            self.timeout_keep_alive_handler()   # uvicorn's own close of an idle connection


@dataclass
class _Repeats:
    last_logged: float
    count: int = 0


class LogOnce:
    """An event loop exception handler that logs each error (by its message) once with its traceback, then only
    how often it came again, at most once a minute. asyncio retries a failing accept() every second and logs each
    try, so a server out of file descriptors would flood its log."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._seen: dict[str, _Repeats] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = context.get("message", "")
        now = self.clock()
        seen = self._seen.get(message)
        if seen is None:
            self._seen[message] = _Repeats(now)
            loop.default_exception_handler(context)
            return
        seen.count += 1
        if now - seen.last_logged >= REPEAT_LOG_SECONDS:
            log.error("%s: %d more times since it was last logged", message, seen.count)
            self._seen[message] = _Repeats(now)
