"""pagedchat: a terminal chat app on its own paged KV-cache engine."""

__all__ = ["Engine", "SamplingParams", "Completion", "FinishReason"]

_LAZY = {"Engine": "pagedchat.engine.engine", "Completion": "pagedchat.engine.engine",
         "SamplingParams": "pagedchat.engine.params", "FinishReason": "pagedchat.engine.records"}


def __getattr__(name):
    # The engine pulls in torch and transformers; importing it lazily keeps `pagedchat --help` quick.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedchat' has no attribute {name!r}")
