"""`pagedchat serve`: uvicorn over the app, listening before the model loads; SIGTERM stops it in seconds."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import uvicorn

from pagedchat.backends.base import TokenBackend
from pagedchat.config import API_KEY_ENV
from pagedchat.errors import PagedChatError
from pagedchat.serve.app import create_app

# On SIGTERM, in-flight replies get this long to finish; then they are cancelled and their pages freed.
GRACEFUL_SECONDS = 3


@dataclass(frozen=True)
class ServeOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    kv_cache_memory: str | None = None
    swap_space: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None

    @property
    def model_name(self) -> str:
        """The name clients send as `model`: what --model said, else the default model's name."""
        if self.model is not None:
            return self.model
        from pagedchat.model.pull import MODEL_NAME

        return MODEL_NAME

    def load_backend(self) -> TokenBackend:
        from pagedchat.backends.local import LocalBackend
        from pagedchat.engine.engine import Engine  # torch loads here, on the loading thread

        return LocalBackend(Engine(self.model, kv_cache_memory=self.kv_cache_memory, swap_space=self.swap_space,
                                   device=self.device, dtype=self.dtype, threads=self.threads))


def serve(options: ServeOptions) -> int:
    """Run until SIGTERM or ctrl+c; a model that fails to load stops the server with its error."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    failure: list[BaseException] = []
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None

    def on_load_failure(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    app = create_app(options.load_backend, options.model_name, api_key=api_key, on_load_failure=on_load_failure)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="info",
                            timeout_graceful_shutdown=GRACEFUL_SECONDS, lifespan="on")
    server = uvicorn.Server(config)
    server.run()
    if failure:
        exc = failure[0]
        raise exc if isinstance(exc, PagedChatError) else PagedChatError(f"could not load the model: {exc}")
    return 0
