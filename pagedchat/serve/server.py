"""`pagedchat serve`: uvicorn over the app, listening before the model loads; SIGTERM stops it in seconds."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import uvicorn

from pagedchat.backends.base import TokenBackend
from pagedchat.config import API_KEY_ENV, EngineOptions
from pagedchat.errors import PagedChatError
from pagedchat.serve.routes import create_app
from pagedchat.serve.grammars import COMPILE_SECONDS
from pagedchat.serve.limits import DeadlineH11Protocol

log = logging.getLogger("pagedchat.serve")

# After the drain time, the ended replies' final chunks get this long to reach their clients.
FLUSH_SECONDS = 2.0
# Endpoints that monitors and the app's inspector poll (the inspector asks for the page map every second or so):
# their access log lines are at debug level, so that the log shows the requests people made.
POLLED_PATHS = frozenset({"/v1/memory", "/metrics", "/health"})


class QuietPolls(logging.Filter):
    """A filter for uvicorn's access log: a request to a polled endpoint is a debug record, shown only where the
    log takes debug records."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 3 or str(args[2]).partition("?")[0] not in POLLED_PATHS:   # (client, method, path, ...)
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_polls(logger: logging.Logger) -> None:
    if not any(isinstance(f, QuietPolls) for f in logger.filters):
        logger.addFilter(QuietPolls())


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown gives open replies the drain time to finish, then ends each one with a
    final chunk (finish_reason "abort") and [DONE]: uvicorn alone would cut their streams off mid-body."""

    def __init__(self, config: uvicorn.Config, end_replies: Callable[[], None], drain_seconds: float):
        super().__init__(config)
        self.end_replies = end_replies
        self.drain_seconds = drain_seconds

    async def shutdown(self, sockets=None) -> None:
        ending = asyncio.get_running_loop().call_later(self.drain_seconds, self.end_replies)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()


def exposed(host: str) -> bool:
    """Whether host is reachable from other machines: anything but a loopback address (a name may resolve to any)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True


@dataclass(frozen=True)
class ServeOptions:
    engine: EngineOptions = field(default_factory=EngineOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()        # any of them opens /v1; none: no key needed
    max_requests_per_key: int | None = None   # generation requests one client may have open; None: no limit
    max_request_tokens: int | None = None     # n x max_tokens one request may ask for; None: no limit
    max_body_size: int | None = None      # bytes; None: a few times the model's context (limits.py)
    limit_concurrency: int = 1024         # connections and requests at once; more are answered 503
    timeout_keep_alive: float = 5.0       # seconds a connection may wait without sending a whole request head
    drain_seconds: float = 3.0            # on SIGTERM, how long open replies may go on before they are ended
    grammar_seconds: float = COMPILE_SECONDS   # how long a request waits for its grammar to compile

    @property
    def model_name(self) -> str:
        """The name clients send as `model`: what --model said, else the default model's name."""
        if self.engine.model is not None:
            return self.engine.model
        from pagedchat.model.pull import MODEL_NAME

        return MODEL_NAME

    def load_backend(self) -> TokenBackend:
        from pagedchat.backends.local import LocalBackend
        from pagedchat.engine.engine import Engine  # torch loads here, on the loading thread

        return LocalBackend(Engine(**self.engine.kwargs()))


def serve(options: ServeOptions) -> int:
    """Run until SIGTERM or ctrl+c; a model that fails to load stops the server with its error."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    failure: list[BaseException] = []
    api_keys = options.api_keys or tuple(filter(None, [os.environ.get(API_KEY_ENV)]))
    if not api_keys and exposed(options.host):
        log.warning("listening on %s with no API key: anyone who can reach this port can use the model "
                    "(set --api-key or %s)", options.host, API_KEY_ENV)

    def on_load_failure(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    app = create_app(options.load_backend, options.model_name, api_keys=api_keys, on_load_failure=on_load_failure,
                     max_body_size=options.max_body_size, grammar_seconds=options.grammar_seconds,
                     max_requests_per_key=options.max_requests_per_key,
                     max_request_tokens=options.max_request_tokens)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="info", lifespan="on",
                            http=DeadlineH11Protocol, limit_concurrency=options.limit_concurrency,
                            timeout_keep_alive=options.timeout_keep_alive,
                            timeout_graceful_shutdown=options.drain_seconds + FLUSH_SECONDS)
    quiet_polls(logging.getLogger("uvicorn.access"))   # after uvicorn.Config, which configures its loggers
    server = DrainingServer(config, app.state.server.end_replies, options.drain_seconds)
    server.run()
    if failure:
        exc = failure[0]
        raise exc if isinstance(exc, PagedChatError) else PagedChatError(f"could not load the model: {exc}")
    return 0
