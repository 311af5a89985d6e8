"""Which backend a config asks for: the server it names, else pagedchat's engine (in this process or its own)."""

from __future__ import annotations

from pagedchat.backends.base import Backend, Progress
from pagedchat.config import AppConfig
from pagedchat.errors import PagedChatError

ENGINE_LOG = "engine.log"  # in the data folder: what the engine process printed, a crash's trace included


def open_backend(config: AppConfig, progress: Progress, *, own_process: bool = False) -> Backend:
    """The server named by --server / `server =`, else the engine: in a process of its own with own_process
    (the app: docs in backends/process.py), else in this one. Slow (it loads or connects): the app calls it off
    the UI thread."""
    if config.server:
        from pagedchat.backends.remote import RemoteBackend

        progress(f"connecting to {config.server}", None)
        return RemoteBackend(config.server, config.api_key, config.engine.model, progress)

    if own_process:
        from pagedchat.backends.process import ProcessBackend

        return ProcessBackend(config.engine.kwargs(), progress, log_path=config.data_dir / ENGINE_LOG)

    from pagedchat.backends.local import LocalBackend
    from pagedchat.engine.engine import Engine  # torch loads here

    try:
        engine = Engine(**config.engine.kwargs(), progress=progress)
    except Exception as exc:
        raise PagedChatError(f"The model could not be loaded: {exc}") from exc
    return LocalBackend(engine)
