"""The OpenAI response bodies: whole completions, stream chunks, usage, and the finish-reason mapping."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum

from pagedchat.backends.base import Outcome

# The engine's finish reasons as OpenAI's, plus vLLM's extra `stop_reason` where OpenAI's word loses the
# distinction: an OpenAI client sees "length" at the context limit, and a client that knows vLLM sees why.
_FINISH = {
    "stop": ("stop", None),
    "length": ("length", None),
    "context_full": ("length", "context_full"),
    "cancelled": ("abort", None),   # vLLM's word for a request stopped before it finished
}


def finish_fields(reason: str) -> dict:
    finish, stop_reason = _FINISH.get(reason, (reason, None))
    return {"finish_reason": finish, "stop_reason": stop_reason}


def usage(prompt_tokens: int, outcome: Outcome) -> dict:
    generated = outcome.generated_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


class Kind(Enum):
    """The two endpoints' shapes: where the text goes and what the objects are called."""

    CHAT = ("chat.completion", "chat.completion.chunk", "chatcmpl")
    TEXT = ("text_completion", "text_completion", "cmpl")

    def __init__(self, whole: str, chunk: str, id_prefix: str):
        self.whole = whole
        self.chunk = chunk
        self.id_prefix = id_prefix


@dataclass(frozen=True)
class Reply:
    """One response's fixed parts; its methods build the bodies sent for it."""

    kind: Kind
    id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: Kind, request_id: str, model: str) -> "Reply":
        return cls(kind, request_id, model, int(time.time()))

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, text: str | None, *, whole: bool, finish: dict | None = None, role: bool = False) -> dict:
        finish = finish or {"finish_reason": None}
        if self.kind is Kind.TEXT:
            return {"index": 0, "text": text or "", "logprobs": None, **finish}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, **finish}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, **finish}

    def whole(self, prompt_tokens: int, outcome: Outcome) -> dict:
        choice = self._choice(outcome.text, whole=True, finish=finish_fields(outcome.finish_reason))
        return self._envelope(self.kind.whole, [choice], usage=usage(prompt_tokens, outcome))

    def chunk(self, text: str | None, *, finish_reason: str | None = None, role: bool = False,
              with_usage: bool = False) -> str:
        finish = finish_fields(finish_reason) if finish_reason else None
        extra = {"usage": None} if with_usage else {}
        body = self._envelope(self.kind.chunk, [self._choice(text, whole=False, finish=finish, role=role)], **extra)
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, outcome: Outcome) -> str:
        return sse(self._envelope(self.kind.chunk, [], usage=usage(prompt_tokens, outcome)))


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
