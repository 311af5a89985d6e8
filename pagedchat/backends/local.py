"""The in-process engine behind the backend face: prompt building, and the engine's own handles (RequestHandle
is a ReplyHandle; its Updates and Outcome are the backend face's), forks that share pages."""

from __future__ import annotations

from pathlib import Path

from pagedchat.backends.base import BackendInfo, OnUpdate
from pagedchat.engine.chat_template import chat_prompt_ids, count_limit
from pagedchat.engine.handle import RequestHandle
from pagedchat.engine.kv_snapshot import MemorySnapshot, PoolUsage
from pagedchat.engine.records import Outcome


class LocalBackend:
    """pagedchat's own Engine, in this process: the app's Backend, and the TokenBackend that `pagedchat serve`
    and the bench drive."""

    core_loan = None   # the UI, if any, shares this process's cores as it likes

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
                                pool_bytes=sum(g.num_pages * g.page_bytes for g in plan.groups) or None,
                                vocab_size=engine.config.vocab_size)

    def prompt_ids(self, prompt: str | list[int] | list[dict], previous: Outcome | None = None, *,
                   continue_final: bool = False, parse_special: bool = False) -> list[int]:
        # The context is not checked here: the app and the server compare a prompt's count with it themselves
        # (the server in OpenAI's words), and submit checks. Past count_limit a prompt is only too long: its ids
        # are not all built.
        if not prompt or not isinstance(prompt[0], dict):
            ids = self.engine.tokenize(prompt, parse_special=parse_special)
            self.engine.check_vocabulary(ids)
            return ids
        counted = count_limit(self.engine.config.max_position_embeddings) + 1
        return chat_prompt_ids(self.engine.tokenizer, prompt, previous.history_ids if previous else None,
                               continue_final, self.engine.config.family.system_role, max_length=counted)

    def prompt_tokens(self, messages: list[dict], previous: Outcome | None = None) -> int:
        return len(self.prompt_ids(messages, previous))

    def submit(self, messages: list[dict], params, *, previous: Outcome | None = None,
               on_update: OnUpdate | None = None) -> RequestHandle:
        return self.engine.submit(self.prompt_ids(messages, previous), params, on_update=on_update)

    def submit_ids(self, prompts: list[list[int]], params, *, request_ids: list[str] | None = None,
                   on_update: OnUpdate | None = None, n: int = 1) -> list[RequestHandle]:
        return self.engine.submit_many(prompts, params, request_ids=request_ids, on_update=on_update, n=n)

    def compile_grammar(self, spec):
        return self.engine.compile_grammar(spec)

    def token_texts(self, ids: list[int]) -> list[str]:
        tok = self.engine.tokenizer
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    def usage(self) -> PoolUsage:
        return self.engine.usage()

    def fork(self, parent: RequestHandle, params, *, on_update: OnUpdate | None = None) -> RequestHandle:
        return self.engine.fork(parent.request_id, params, on_update=on_update)

    @property
    def failure(self) -> str | None:
        return self.engine.failure

    def memory(self) -> MemorySnapshot:
        return self.engine.memory()

    def stalled_for(self) -> None:
        return None   # the engine runs in this process: a stopped engine is a stopped app

    def shutdown(self) -> None:
        self.engine.shutdown()
