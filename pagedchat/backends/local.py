"""The in-process engine behind the backend face: prompt building, deltas to Updates, forks that share pages."""

from __future__ import annotations

import threading
from pathlib import Path

from pagedchat.backends.base import BackendInfo, OnUpdate, Outcome, Update
from pagedchat.engine.chat import chat_prompt_ids, count_limit
from pagedchat.engine.memory import MemorySnapshot, PoolUsage
from pagedchat.engine.sequence import Completion, StreamDelta


def outcome_of(c: Completion) -> Outcome:
    return Outcome(request_id=c.request_id, text=c.text, finish_reason=c.finish_reason,
                   prompt_tokens=len(c.prompt_token_ids), cached_tokens=c.cached_tokens,
                   prefilled_tokens=c.prefilled_tokens,
                   generated_tokens=len(c.token_ids), time_to_first_token=c.time_to_first_token,
                   tokens_per_s=c.decode_tokens_per_s, error=c.error, pages=tuple(c.pages),
                   token_ids=tuple(c.prompt_token_ids) + tuple(c.token_ids), logprobs=tuple(c.logprobs))


class LocalReply:
    """One engine request seen through the face. A fork also knows its parent's prompt length, so that its
    first update can say which of the parent's reply tokens it starts from (the parent may grow until the
    engine thread takes the fork in)."""

    def __init__(self, backend: "LocalBackend", on_update: OnUpdate | None, parent_prompt_len: int | None = None):
        self._backend = backend
        self._on_update = on_update
        self._parent_prompt_len = parent_prompt_len
        self._bound = threading.Event()
        self.handle = None
        self.request_id = ""

    def bind(self, handle) -> "LocalReply":
        self.handle, self.request_id = handle, handle.request_id
        self._bound.set()
        return self

    def on_delta(self, delta: StreamDelta) -> None:
        """Engine thread. A delta can come before submit() has returned the handle; wait for it (microseconds)."""
        self._bound.wait()
        inherited = None
        if self._parent_prompt_len is not None:
            ids = self.handle.prompt_token_ids[self._parent_prompt_len:]
            inherited = self._backend.engine.tokenizer.decode(ids, skip_special_tokens=True)
            self._parent_prompt_len = None
        outcome = outcome_of(delta.completion) if delta.finished else None
        if self._on_update is not None:
            self._on_update(Update(delta.request_id, delta.text, len(delta.token_ids), inherited=inherited,
                                   outcome=outcome, logprobs=tuple(delta.logprobs)))

    def cancel(self) -> None:
        self._backend.engine.cancel(self.request_id)

    def so_far(self) -> Outcome:
        h = self.handle
        return Outcome(self.request_id, prompt_tokens=len(h.prompt_token_ids), cached_tokens=h.cached_tokens,
                       time_to_first_token=h.time_to_first_token, tokens_per_s=h.decode_tokens_per_s)

    def result(self, timeout: float | None = None) -> Outcome:
        return outcome_of(self.handle.result(timeout))


class LocalBackend:
    """pagedchat's own Engine, in this process: the app's Backend, and the TokenBackend that `pagedchat serve`
    and the bench drive."""

    def __init__(self, engine) -> None:
        self.engine = engine
        plan = engine.cache_plan
        precision = str(engine.dtype).removeprefix("torch.")
        weights = engine.model.weight_precision
        if weights != precision:  # packed weights run in their own format beside the activations' dtype
            precision += f" · weights {weights}"
        self.info = BackendInfo(model=Path(str(engine.model_path)).name, where=f"on {engine.device} · {precision}",
                                context_length=engine.config.max_position_embeddings, block_size=engine.block_size,
                                num_pages=plan.num_pages, page_bytes=plan.page_bytes,
                                vocab_size=engine.config.vocab_size)

    def prompt_ids(self, prompt: str | list[int] | list[dict], previous: Outcome | None = None, *,
                   continue_final: bool = False) -> list[int]:
        if not prompt or not isinstance(prompt[0], dict):
            return self.engine.encode_prompt(prompt)
        # Chat ids are not checked here: the app compares their count with the context itself, and submit checks.
        # Past count_limit a prompt is only too long: its ids are not all built.
        counted = count_limit(self.engine.config.max_position_embeddings) + 1
        return chat_prompt_ids(self.engine.tokenizer, prompt, list(previous.token_ids) if previous else None,
                               continue_final, self.engine.config.family.system_role, max_length=counted)

    def prompt_tokens(self, messages: list[dict], previous: Outcome | None = None) -> int:
        return len(self.prompt_ids(messages, previous))

    def submit(self, messages: list[dict], params, *, previous: Outcome | None = None,
               on_update: OnUpdate | None = None) -> LocalReply:
        ids = self.prompt_ids(messages, previous)
        reply = LocalReply(self, on_update)
        return reply.bind(self.engine.submit(ids, params, on_update=reply.on_delta))

    def submit_ids(self, prompts: list[list[int]], params, *, request_ids: list[str] | None = None,
                   on_update: OnUpdate | None = None, n: int = 1) -> list[LocalReply]:
        # The engine takes one callback for the batch: route each delta to its reply by request id, once all
        # are known (a delta can come before submit_many returns).
        by_id: dict[str, LocalReply] = {}
        routed = threading.Event()

        def route(delta: StreamDelta) -> None:
            routed.wait()
            by_id[delta.request_id].on_delta(delta)

        handles = self.engine.submit_many(prompts, params, request_ids=request_ids, on_update=route, n=n)
        for handle in handles:
            by_id[handle.request_id] = LocalReply(self, on_update).bind(handle)
        routed.set()
        return [by_id[h.request_id] for h in handles]

    def compile_grammar(self, spec):
        return self.engine.compile_grammar(spec)

    def token_texts(self, ids: list[int]) -> list[str]:
        tok = self.engine.tokenizer
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    def usage(self) -> PoolUsage:
        return self.engine.usage()

    def fork(self, parent: LocalReply, params, *, on_update: OnUpdate | None = None) -> LocalReply:
        reply = LocalReply(self, on_update, parent_prompt_len=len(parent.handle.prompt_token_ids))
        return reply.bind(self.engine.fork(parent.request_id, params, on_update=reply.on_delta))

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    def memory(self) -> MemorySnapshot:
        return self.engine.memory()

    def shutdown(self) -> None:
        self.engine.shutdown()
