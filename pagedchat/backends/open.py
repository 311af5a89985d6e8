"""Which backend a config asks for: the server it names, else the engine in this process."""

from __future__ import annotations

from typing import Callable

from pagedchat.backends.base import Backend
from pagedchat.config import AppConfig
from pagedchat.errors import PagedChatError

Progress = Callable[[str, "float | None"], None]


def open_backend(config: AppConfig, progress: Progress) -> Backend:
    """The server named by --server / `server =`, else the engine in this process. Slow (it loads or
    connects): the app calls it off the UI thread."""
    if config.server:
        from pagedchat.backends.remote import RemoteBackend

        progress(f"connecting to {config.server}", None)
        return RemoteBackend(config.server, config.api_key, config.model, progress)

    from pagedchat.backends.local import LocalBackend
    from pagedchat.engine.engine import Engine  # torch loads here

    try:
        engine = Engine(config.model, kv_cache_memory=config.kv_cache_memory, block_size=config.block_size,
                        device=config.device, dtype=config.dtype, swap_space=config.swap_space,
                        threads=config.threads, progress=progress, quantize=config.quantize)
    except Exception as exc:
        raise PagedChatError(f"The model could not be loaded: {exc}") from exc
    return LocalBackend(engine)
