"""pagedchat: a terminal chat app on its own paged KV-cache engine."""

from pagedchat.engine.sampling import SamplingParams

__all__ = ["Engine", "SamplingParams", "Completion"]


def __getattr__(name):
    # The engine pulls in torch and transformers; importing it lazily keeps `pagedchat --help` quick.
    if name in ("Engine", "Completion"):
        from pagedchat.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
