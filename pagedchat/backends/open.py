"""Which backend a config asks for: the server it names, else pagedchat's engine (in this process or its own)."""

from __future__ import annotations

from typing import Any

from pagedchat.backends.base import Backend, Progress
from pagedchat.config import AppConfig
from pagedchat.errors import PagedChatError

ENGINE_LOG = "engine.log"  # in the data folder: what the engine process printed, a crash's trace included


def engine_options(config: AppConfig) -> dict[str, Any]:
    """The Engine keyword arguments a config sets."""
    return dict(model=config.model, kv_cache_memory=config.kv_cache_memory, block_size=config.block_size,
                device=config.device, dtype=config.dtype, swap_space=config.swap_space, threads=config.threads,
                quantize=config.quantize)


def open_backend(config: AppConfig, progress: Progress, *, own_process: bool = False) -> Backend:
    """The server named by --server / `server =`, else the engine: in a process of its own with own_process
    (the app: docs in backends/process.py), else in this one. Slow (it loads or connects): the app calls it off
    the UI thread."""
    if config.server:
        from pagedchat.backends.remote import RemoteBackend

        progress(f"connecting to {config.server}", None)
        return RemoteBackend(config.server, config.api_key, config.model, progress)

    if own_process:
        from pagedchat.backends.process import ProcessBackend

        return ProcessBackend(engine_options(config), progress, log_path=config.data_dir / ENGINE_LOG)

    from pagedchat.backends.local import LocalBackend
    from pagedchat.engine.engine import Engine  # torch loads here

    try:
        engine = Engine(**engine_options(config), progress=progress)
    except Exception as exc:
        raise PagedChatError(f"The model could not be loaded: {exc}") from exc
    return LocalBackend(engine)
