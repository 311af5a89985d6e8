"""The OpenAI response bodies: whole completions, stream chunks, usage, log-probabilities, tool calls, and the
finish-reason mapping."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.serve.calls import ToolCall
from pagedchat.serve.tools import OutputPlan, ReplyShape

# Each finish reason a backend gives as OpenAI's word, plus vLLM's extra `stop_reason` where OpenAI's word loses
# the distinction: an OpenAI client sees "length" at the context limit, and a client that knows vLLM sees why.
# (INTERRUPTED is the app's own, never a backend's.)
_FINISH = {
    FinishReason.STOP: ("stop", None),
    FinishReason.LENGTH: ("length", None),
    FinishReason.CONTEXT_FULL: ("length", "context_full"),
    FinishReason.TOOL_CALLS: ("tool_calls", None),
    FinishReason.CANCELLED: ("abort", None),   # vLLM's word for a request stopped before it finished
    FinishReason.ERROR: ("error", None),       # vLLM's; a failed reply is answered with an error body instead
}

TokenTexts = Callable[[list[int]], list[str]]


def finish_fields(reason: FinishReason, calls: bool = False) -> dict:
    """A reply that ends with a plan's tool calls finishes with "tool_calls" (the engine stops with STOP)."""
    finish, stop_reason = _FINISH[FinishReason.TOOL_CALLS if calls and reason is FinishReason.STOP else reason]
    return {"finish_reason": finish, "stop_reason": stop_reason}


def usage(prompt_tokens: int, outcomes: list[Outcome]) -> dict:
    """The prompt counts once however many replies (n) were drawn from it."""
    generated = sum(o.generated_tokens for o in outcomes)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": outcomes[0].cached_tokens}}


class Kind(Enum):
    """The two endpoints' shapes: where the text goes and what the objects are called."""

    CHAT = ("chat.completion", "chat.completion.chunk", "chatcmpl")
    TEXT = ("text_completion", "text_completion", "cmpl")

    def __init__(self, whole: str, chunk: str, id_prefix: str):
        self.whole = whole
        self.chunk = chunk
        self.id_prefix = id_prefix


@dataclass(frozen=True)
class ResponseBuilder:
    """One response's fixed parts; its methods build the bodies sent for it."""

    kind: Kind
    id: str
    model: str
    created: int
    token_texts: TokenTexts = field(compare=False)   # how log-probabilities name tokens
    plan: OutputPlan = OutputPlan()

    @classmethod
    def new(cls, kind: Kind, request_id: str, model: str, token_texts: TokenTexts,
            plan: OutputPlan | None = None) -> "ResponseBuilder":
        return cls(kind, request_id, model, int(time.time()), token_texts, plan or OutputPlan())

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    # ---- log-probabilities, in each endpoint's shape ---------------------------------------------------------
    def logprobs(self, sampled, text_offset: int = 0) -> dict | None:
        if not sampled:
            return None
        ids = [s.token for s in sampled] + [t.token_id for s in sampled for t in s.top]
        names = dict(zip(ids, self.token_texts(ids)))
        if self.kind is Kind.TEXT:
            tokens = [names[s.token] for s in sampled]
            offsets = [text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            return {"tokens": tokens, "token_logprobs": [s.logprob.logprob for s in sampled],
                    "top_logprobs": [{names[t.token_id]: t.logprob for t in s.top} for s in sampled],
                    "text_offset": offsets}

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": names[token_id], "logprob": logprob, "bytes": list(names[token_id].encode())}

        return {"content": [{**entry(s.token, s.logprob.logprob), "top_logprobs": [entry(t.token_id, t.logprob)
                                                                                 for t in s.top]}
                            for s in sampled]}

    # ---- whole responses -----------------------------------------------------------------------------------
    def calls(self, text: str, reason: FinishReason) -> list[ToolCall]:
        """The calls of a finished reply; one cut short (max_tokens, the context, a cancel) keeps the call it was
        writing, with its arguments so far, as OpenAI and vLLM give it, streamed or not."""
        return self.plan.tool_calls(text, complete=reason is FinishReason.STOP)

    def _whole_choice(self, index: int, outcome: Outcome) -> dict:
        logprobs = self.logprobs(outcome.logprobs)
        if self.kind is Kind.TEXT:
            return {"index": index, "text": outcome.text, "logprobs": logprobs,
                    **finish_fields(outcome.finish_reason)}
        calls = self.calls(outcome.text, outcome.finish_reason)
        message = {"role": "assistant", "content": self.plan.content(outcome.text, calls)}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return {"index": index, "message": message, "logprobs": logprobs,
                **finish_fields(outcome.finish_reason, bool(calls))}

    def whole(self, prompt_tokens: int, outcomes: list[Outcome]) -> dict:
        choices = [self._whole_choice(i, o) for i, o in enumerate(outcomes)]
        return self._envelope(self.kind.whole, choices, usage=usage(prompt_tokens, outcomes))

    # ---- stream chunks -------------------------------------------------------------------------------------
    def chunk(self, index: int, text: str | None, *, finish_reason: FinishReason | None = None, role: bool = False,
              with_usage: bool = False, sampled=(), calls: list[ToolCall] = ()) -> str:
        finish = finish_fields(finish_reason, bool(calls)) if finish_reason else {"finish_reason": None}
        logprobs = self.logprobs(sampled)
        if self.kind is Kind.TEXT:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, **finish}
        else:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, **finish}
        extra = {"usage": None} if with_usage else {}
        return sse(self._envelope(self.kind.chunk, [choice], **extra))

    def call_chunk(self, index: int, arguments: str, *, first: bool, finish_reason: FinishReason | None = None,
                   with_usage: bool = False, sampled=()) -> str:
        """A piece of a named tool call's arguments, as they come; the first piece carries the call's id and
        name."""
        call = {"index": 0, "function": {"arguments": arguments}}
        if first:
            call = {**ToolCall(self.plan.named, arguments).as_openai(0)}
        finish = finish_fields(finish_reason, True) if finish_reason else {"finish_reason": None}
        choice = {"index": index, "delta": {"tool_calls": [call]}, "logprobs": self.logprobs(sampled), **finish}
        extra = {"usage": None} if with_usage else {}
        return sse(self._envelope(self.kind.chunk, [choice], **extra))

    def usage_chunk(self, prompt_tokens: int, outcomes: list[Outcome]) -> str:
        return sse(self._envelope(self.kind.chunk, [], usage=usage(prompt_tokens, outcomes)))


class ChoiceChunks:
    """The SSE chunks of n replies streamed together, each tagged with its choice index: text as it comes; a
    named tool call's arguments as tool_calls deltas; a reply that may or may not be a call (tool_choice
    required or auto) held to its end, then sent as one tool_calls delta, or as text when it calls nothing."""

    def __init__(self, builder: ResponseBuilder, n: int, with_usage: bool):
        self.builder = builder
        self.with_usage = with_usage
        self.named = builder.plan.shape is ReplyShape.TOOL_NAMED
        self.held = builder.plan.calls_tools and not self.named
        self.texts = [""] * n
        self.called = [False] * n          # a named call's first delta (its id and name) is sent
        self.outcomes: list[Outcome | None] = [None] * n

    def opening(self) -> list[str]:
        if self.builder.kind is not Kind.CHAT:
            return []
        return [self.builder.chunk(i, "", role=True, with_usage=self.with_usage) for i in range(len(self.texts))]

    def feed(self, i: int, update: Update) -> list[str]:
        """The chunks for reply i's update (never a failed one: the caller sends the error)."""
        self.texts[i] += update.text
        self.outcomes[i] = update.outcome
        reason = update.outcome.finish_reason if update.finished else None
        if self.named:
            if not (update.text or update.finished):
                return []
            first, self.called[i] = not self.called[i], True
            return [self.builder.call_chunk(i, update.text, first=first, finish_reason=reason,
                                          with_usage=self.with_usage, sampled=update.logprobs)]
        if not update.finished:
            if (update.text and not self.held) or update.logprobs:
                return [self.builder.chunk(i, None if self.held else update.text, with_usage=self.with_usage,
                                         sampled=update.logprobs)]
            return []
        calls = self.builder.calls(self.texts[i], reason) if self.held else []
        text = (self.builder.plan.content(self.texts[i], calls) if self.held else update.text) or None
        return [self.builder.chunk(i, text, finish_reason=reason, with_usage=self.with_usage, sampled=update.logprobs,
                                 calls=calls)]

    def closing(self, prompt_tokens: int) -> list[str]:
        return [self.builder.usage_chunk(prompt_tokens, self.outcomes)] if self.with_usage else []


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
