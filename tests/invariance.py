"""Same request, same tokens: helpers for the tests that hold a reply to its alone-in-a-fresh-engine bits, whatever
ran beside it, however its prompt was chunked, wherever its prefix came from
(docs/architecture.md#same-request-same-tokens). Reusable by any feature that must keep that promise
(speculation's verify steps, say)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf

from pagedchat import Engine, SamplingParams
from pagedchat.model.gguf import convert_gguf
from tiny_gguf import gguf_name, write_tiny_gguf
from tiny_models import make_tiny_model


def tiny_packed_model(root: Path, kind: str = "Q4_1", **model_kwargs) -> Path:
    """A tiny llama as a GGUF of `kind` blocks (256 wide: whole K-quant super-blocks), converted: a model that
    runs the default path, packed weights on pagedchat's kernels and native attention."""
    from safetensors.torch import load_file

    src = make_tiny_model(root / "src", head_dim=64, **model_kwargs)
    names = tuple(gguf_name(n) for n, t in load_file(src / "model.safetensors").items() if t.dim() == 2)
    path = write_tiny_gguf(src, root / "tiny.gguf", quantized=names, qtype=gguf.GGMLQuantizationType[kind])
    return convert_gguf(path, root / "out")


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Reply:
    """What must not change: every token and its log-probability, bit for bit."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


def reply_of(outcome) -> Reply:
    assert outcome.finish_reason in ("stop", "length"), outcome.error
    return Reply(tuple(outcome.token_ids), tuple(s.logprob.logprob for s in outcome.logprobs))


def drain(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def run_together(engine: Engine, requests: list[Request]) -> list[Reply]:
    """The requests submitted at once into an engine made with autostart=False, run to the end."""
    handles = [engine.submit(r.prompt, r.params) for r in requests]
    drain(engine)
    return [reply_of(h.result(timeout=0)) for h in handles]


def run_alone(folder: Path, requests: list[Request], **engine_kwargs) -> list[Reply]:
    """Each request alone in a fresh engine: the reference."""
    replies = []
    for request in requests:
        engine = Engine(str(folder), autostart=False, **engine_kwargs)
        replies += run_together(engine, [request])
        engine.shutdown()
    return replies


def differing(got: list[Reply], want: list[Reply]) -> list[int]:
    """The indices of the replies that are not the same bits."""
    return [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
