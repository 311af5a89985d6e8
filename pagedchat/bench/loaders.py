"""`--against NAME` -> the loader of that peer (tests put stand-ins here). Each peer module is imported only when
its peer is asked for: transformers and llama-cpp-python are heavy, and optional."""

from __future__ import annotations

from typing import Callable

from pagedchat.bench.peers import Peer


def load_transformers(cfg, engine, work) -> Peer:
    from pagedchat.bench import hf

    return hf.peer(engine, work)


def load_llamacpp(cfg, engine, work) -> Peer:
    from pagedchat.bench import llamacpp

    return llamacpp.peer(cfg, engine, work)


LOADERS: dict[str, Callable[..., Peer]] = {"transformers": load_transformers, "llama.cpp": load_llamacpp}
