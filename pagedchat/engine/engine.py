"""The engine: requests in, tokens out, one background thread (see compute_thread) stepping the model.

Data path: submit() -> inbox -> Scheduler (block tables, copy plan) -> ModelRunner (one forward over every
scheduled chunk) -> Sampler -> Detokenizer -> StreamDelta to each request's handle and callback.
Other threads never touch the scheduler directly: they post to the inbox, which the loop drains between
steps, so a cancel can never free pages a running forward pass still reads.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Union

import torch

from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.compute_thread import ComputeThread
from pagedchat.engine.detokenizer import Detokenizer
from pagedchat.engine.memory import MemorySnapshot, snapshot
from pagedchat.engine.model_runner import ModelRunner
from pagedchat.engine.sampling import Sampler, SamplingParams
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.sequence import Completion, Sequence, SeqStatus, StreamDelta
from pagedchat.engine.sizing import parse_bytes, parse_dtype, plan_cache
from pagedchat.errors import RequestError
from pagedchat.model.config import ModelConfig
from pagedchat.model.llama import LlamaModel
from pagedchat.model.loader import eos_token_ids, load_tokenizer, load_weights, resolve_model

log = logging.getLogger("pagedchat.engine")

Prompt = Union[str, list[int], list[dict]]
__all__ = ["Engine", "Completion", "RequestHandle", "StreamDelta"]


@dataclass(eq=False)
class RequestHandle:
    """A request in flight. Thread-safe: iterate it for StreamDeltas, or wait on result()."""

    request_id: str
    prompt_token_ids: list[int]
    _engine: "Engine"
    on_update: Callable[[StreamDelta], None] | None = None
    _deltas: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _done: threading.Event = field(default_factory=threading.Event)
    _completion: Completion | None = None
    # Live figures, updated by the engine thread after each step.
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    time_to_first_token: float | None = None
    decode_tokens_per_s: float | None = None

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running after {timeout}s")
        return self._completion

    def __iter__(self):
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finished:
                return

    def _deliver(self, delta: StreamDelta, seq: Sequence) -> None:
        self.cached_tokens = seq.cached_tokens
        self.prefilled_tokens = seq.prefilled_tokens
        # Only the figures: a whole Completion copies every token id, on every step of every request.
        self.time_to_first_token, self.decode_tokens_per_s = seq.timing()
        if delta.finished:
            self._completion = delta.completion
        self._deltas.put(delta)
        if self.on_update is not None:
            try:
                self.on_update(delta)
            except Exception:  # a broken listener must not stop the engine
                log.exception("on_update callback failed for %s", self.request_id)
        if delta.finished:
            self._done.set()


class Engine:
    """A paged KV-cache LLM engine. See README "Python API"."""

    def __init__(self, model=None, *, kv_cache_memory: int | str | None = None, block_size: int = 16,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 swap_space: int | str | None = None, max_tokens_per_step: int = 512, max_seqs: int = 64,
                 threads: int | None = None, progress: Callable[[str, float | None], None] | None = None):
        folder = resolve_model(model, progress)
        self.model_path = folder
        self.config = ModelConfig.from_folder(folder)
        self.tokenizer = load_tokenizer(folder)
        self.eos_token_ids = frozenset(eos_token_ids(folder, self.config.eos_token_ids, self.tokenizer))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(dtype, self.device)
        if progress:
            progress("loading weights", None)
        self._compute = ComputeThread("pagedchat-engine", threads)
        try:
            self.model = self._compute.call(self._load_model, folder)
            self.block_size = block_size
            self.cache_plan = plan_cache(self.config, self.dtype, self.device, block_size,
                                         parse_bytes(kv_cache_memory), parse_bytes(swap_space))
            self.runner = self._compute.call(ModelRunner, self.model, self.cache_plan.num_pages,
                                             self.cache_plan.num_cpu_pages, block_size)
        except BaseException:
            self._compute.close()
            raise
        # An engine dropped without shutdown() frees its idle thread. Not at interpreter exit: the thread is a
        # daemon, and a live loop would make close() wait there.
        weakref.finalize(self, self._compute.close, 0).atexit = False
        self.blocks = BlockManager(self.cache_plan.num_pages, block_size, self.cache_plan.num_cpu_pages)
        self.scheduler = Scheduler(self.blocks, max_tokens_per_step, max_seqs)
        self.sampler = Sampler()
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._lock = threading.Lock()           # the scheduler's state, between steps
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._seqs: dict[str, Sequence] = {}     # live sequences by request id
        self._history: dict[str, list[int]] = {}  # finished requests' tokens, for fork
        self._stopped = False
        self._looping = False
        self.steps = 0

    def _load_model(self, folder) -> LlamaModel:
        return LlamaModel(self.config, load_weights(folder, self.dtype, self.device), self.device, self.dtype)

    # ---- public API --------------------------------------------------------------------------------------
    def describe(self) -> str:
        p = self.cache_plan
        return (f"{self.config.architecture} from {self.model_path} on {self.device} ({str(self.dtype).split('.')[-1]}); "
                f"KV cache {p.gpu_bytes / 2**20:.0f} MiB = {p.num_pages} pages x {self.block_size} tokens "
                f"({p.page_bytes // self.block_size} bytes/token), CPU tier {p.num_cpu_pages} pages"
                f"{' (' + p.reason + ')' if p.reason else ''}")

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif prompt and all(isinstance(m, dict) for m in prompt):
            if not self.tokenizer.chat_template:
                raise RequestError("this model has no chat template: pass the prompt as plain text")
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        self._validate(ids)
        return ids

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_update: Callable[[StreamDelta], None] | None = None, request_id: str | None = None) -> RequestHandle:
        """Queue a request; tokens stream to the handle (and on_update, on the engine thread) as they come."""
        return self.submit_many([prompt], params, on_update=on_update, request_ids=[request_id])[0]

    def submit_many(self, prompts: list[Prompt], params: SamplingParams | None = None, *,
                    on_update=None, request_ids: list[str | None] | None = None) -> list[RequestHandle]:
        """Queue several requests so that they are admitted in the same step."""
        self._check_running()
        params = params or SamplingParams()
        encoded = [self.encode_prompt(p) for p in prompts]  # fails before anything is queued
        for ids in encoded:
            self._check_fits(ids, params)
        handles = []
        for ids, rid in zip(encoded, request_ids or [None] * len(prompts)):
            seq = self._new_sequence(ids, params, rid)
            handle = RequestHandle(seq.request_id, ids, self, on_update)
            handles.append(handle)
            self._inbox.put(("add", seq, handle))
        self._kick()
        return handles

    def fork(self, request_id: str, params: SamplingParams | None = None, *,
             on_update: Callable[[StreamDelta], None] | None = None) -> RequestHandle:
        """Continue request_id's tokens (prompt and output so far) as a new request.

        A live parent shares all its pages with the child, copy-on-write; a finished one is resumed from the
        prefix cache."""
        self._check_running()
        with self._lock:
            parent = self._seqs.get(request_id)
            tokens = list(parent.token_ids) if parent else self._history.get(request_id)
        if tokens is None:
            raise RequestError(f"no request {request_id!r} to fork")
        params = params or SamplingParams()
        self._check_fits(tokens, params)
        seq = self._new_sequence(tokens, params, None)
        handle = RequestHandle(seq.request_id, tokens, self, on_update)
        self._inbox.put(("fork", seq, handle, request_id))
        self._kick()
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._kick()

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[Completion]:
        """Run prompts concurrently and wait for all of them."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        handles = self.submit_many(list(prompts), params)
        return [h.result() for h in handles]

    def memory(self) -> MemorySnapshot:
        """A consistent picture of the page pool; safe to call from any thread while the engine runs."""
        with self._lock:
            return snapshot(self.blocks, self.scheduler, self.config.max_position_embeddings,
                            self.cache_plan.page_bytes)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._compute.close()

    # ---- validation ----------------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._stopped:
            raise RequestError("the engine has been shut down")

    def _validate(self, ids: list[int]) -> None:
        ctx = self.config.max_position_embeddings
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens but the model's context holds {ctx}: "
                               "shorten it or start a new chat")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        longest = min(len(ids) + params.max_tokens, self.config.max_position_embeddings)
        need = self.blocks.pages_for(longest)
        if need > self.blocks.num_pages:
            raise RequestError(
                f"this request can grow to {longest} tokens ({need} pages) but the KV cache holds "
                f"{self.blocks.num_pages} pages of {self.block_size}: lower max_tokens or raise kv_cache_memory")

    def _new_sequence(self, ids: list[int], params: SamplingParams, rid: str | None) -> Sequence:
        seq = Sequence(request_id=rid or f"req-{next(self._ids)}", token_ids=list(ids),
                       num_prompt_tokens=len(ids), params=params)
        if not params.greedy:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        return seq

    # ---- the loop ----------------------------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._looping:
            with self._lock:
                if not self._looping:
                    self._looping = True
                    self._compute.start(self._loop)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopped:
            if not self.step():
                with self._lock:
                    busy = self.scheduler.has_work()
                if not busy and self._inbox.empty():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()

    def step(self) -> list[StreamDelta]:
        """Drain the inbox, schedule, run one forward pass, sample, and hand each request its delta.

        The loop thread calls this; tests may call it directly (with the thread kept off) to go step by step."""
        out = self._step()
        for handle, delta, seq in out:  # outside the lock: listeners may call memory()
            handle._deliver(delta, seq)
        return [delta for _, delta, _ in out]

    def _step(self) -> list[tuple[RequestHandle, StreamDelta, Sequence]]:
        with self._lock:
            out = self._drain_inbox()
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            self.runner.copy_pages(plan.ops)  # preemptions may have planned swap-outs
            with self._lock:
                self.blocks.end_step()
            return out
        try:
            self.runner.copy_pages(plan.ops)
            logits = self.runner.execute(plan)
            sampling = [s.seq for s in plan.scheduled if s.samples]
            tokens = self.sampler(logits, [s.params for s in sampling], [s.generator for s in sampling])
        except Exception as exc:  # keep serving the others: fail only this step's requests
            log.exception("engine step failed")
            with self._lock:
                for item in plan.scheduled:
                    self.blocks.forget_hashes(item.seq)
                    out.append(self._finish(item.seq, "error", f"{type(exc).__name__}: {exc}"))
                self.blocks.end_step()
            return out
        now = time.perf_counter()
        with self._lock:
            self.steps += 1
            token_iter = iter(tokens)
            for item in plan.scheduled:
                seq = item.seq
                if seq.num_computed < seq.num_prompt_tokens:
                    seq.prefilled_tokens += min(item.num_tokens, seq.num_prompt_tokens - seq.num_computed)
                seq.num_computed += item.num_tokens
                if item.samples:
                    out.extend(self._append_token(seq, next(token_iter), now))
            self.blocks.end_step()
        return out

    def _drain_inbox(self) -> list:
        out = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return out
            kind = msg[0]
            if kind == "add":
                _, seq, handle = msg
                self._handles[seq.request_id] = handle
                self._seqs[seq.request_id] = seq
                self.scheduler.add(seq)
            elif kind == "fork":
                out.extend(self._start_fork(*msg[1:]))
            elif kind == "cancel":
                seq = self._seqs.get(msg[1])
                if seq is not None:
                    out.append(self._finish(seq, "cancelled"))

    def _start_fork(self, seq: Sequence, handle: RequestHandle, parent_id: str) -> list:
        """Map a live parent's pages into the child (copy-on-write); otherwise queue it for the prefix cache."""
        self._handles[seq.request_id] = handle
        self._seqs[seq.request_id] = seq
        parent = self._seqs.get(parent_id)
        if parent is not None:  # the parent may have grown since fork() checked the size
            seq.token_ids = list(parent.token_ids)
            seq.num_prompt_tokens = len(seq.token_ids)
            handle.prompt_token_ids = list(seq.token_ids)
            try:
                self._check_fits(seq.token_ids, seq.params)
            except RequestError as exc:
                return [self._finish(seq, "error", str(exc))]
        live = parent is not None and parent.status is SeqStatus.RUNNING
        if live and len(self.scheduler.running) < self.scheduler.max_seqs:
            self.blocks.fork(parent, seq)
            seq.admitted = True
            seq.cached_tokens = parent.num_computed
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq)
        return []

    def _append_token(self, seq: Sequence, token: int, now: float) -> list:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.params
        text, stopped = self.detokenizer.step(seq)
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        reason = None
        if stopped or (token in self.eos_token_ids and not p.ignore_eos):
            reason = "stop"
        elif n_out >= p.max_tokens or len(seq.token_ids) >= self.config.max_position_embeddings:
            reason = "length"
        if reason:
            return [self._finish(seq, reason, new_token=token, text=text)]
        delta = StreamDelta(seq.request_id, [token], text)
        return [(self._handles[seq.request_id], delta, seq)]

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, new_token: int | None = None,
                text: str = ""):
        """Release seq's pages at once and build its final delta (text: what this step already decoded)."""
        text += self.detokenizer.flush(seq)
        seq.finish_reason = reason
        seq.error = error
        completion = seq.completion()
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._seqs.pop(seq.request_id, None)
        self._history[seq.request_id] = list(seq.token_ids)
        if len(self._history) > 1024:
            self._history.pop(next(iter(self._history)))
        handle = self._handles.pop(seq.request_id)
        tokens = [new_token] if new_token is not None else []
        return handle, StreamDelta(seq.request_id, tokens, text, finished=True, completion=completion), seq
