"""pagedchat: a terminal chat app on its own paged KV-cache engine."""

__all__ = ["Engine", "SamplingParams", "Outcome", "Update", "FinishReason"]

_LAZY = {"Engine": "pagedchat.engine.engine", "SamplingParams": "pagedchat.engine.params",
         "Outcome": "pagedchat.engine.records", "Update": "pagedchat.engine.records",
         "FinishReason": "pagedchat.engine.records"}


def __getattr__(name):
    # The engine pulls in torch and transformers; importing it lazily keeps `pagedchat --help` quick.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedchat' has no attribute {name!r}")
