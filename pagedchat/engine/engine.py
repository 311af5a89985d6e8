"""The engine: requests in, tokens out, one background thread (see compute_thread) stepping the model.

Data path: submit() -> inbox -> EngineCore (Scheduler: block tables, copy plan) -> ModelRunner (one forward
over every scheduled chunk) -> Sampler -> EngineCore.postprocess (Detokenizer, stops) -> an Update to each
request's handle and callback. Other threads never touch the core directly: they post to the inbox, which
each step drains first, so a cancel can never free pages a running forward pass still reads.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Union

import torch

from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.compute_thread import ComputeThread
from pagedchat.engine.core import EngineCore, FaultHook, Output, Phase
from pagedchat.engine.detokenizer import Detokenizer
from pagedchat.engine.handle import RequestHandle
from pagedchat.engine.chat_template import chat_prompt_ids, count_limit, encode_up_to, prompt_size
from pagedchat.engine.kv_snapshot import MemorySnapshot, PoolUsage, snapshot
from pagedchat.engine.model_runner import ModelRunner
from pagedchat.engine.ngram import Speculation, parse_speculative
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.params import SamplingParams, sibling_seed
from pagedchat.engine.records import FinishReason, Outcome, Sampled, Update
from pagedchat.engine.sampling import Row, Sampler
from pagedchat.engine.scheduler import STEP_SECONDS, Scheduler, StepPlan, StepTimer
from pagedchat.engine.sequence import Sequence
from pagedchat.engine.structured import CompiledGrammar, GrammarCompiler, GrammarSpec
from pagedchat.engine.core_loan import CoreLoan
from pagedchat.engine.threads import Lender, ThreadGovernor, step_threads
from pagedchat.engine.sizing import parse_bytes, parse_dtype, parse_quantize, plan_cache
from pagedchat.errors import RequestError
from pagedchat.kernels import kv_pages
from pagedchat.model import packed_cache, qmm
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.gguf import gguf_weights
from pagedchat.model.decoder import DecoderModel
from pagedchat.model.loader import eos_token_ids, load_tokenizer, load_weights, resolve_model

log = logging.getLogger("pagedchat.engine")

Prompt = Union[str, list[int], list[dict]]
__all__ = ["Engine", "Outcome", "RequestHandle", "Update"]

# Steps in a row that failed and failed no request: the engine is stuck on something no request explains.
MAX_BLAMELESS_FAULTS = 3


@dataclass(frozen=True)
class _Add:
    seq: Sequence
    siblings: tuple[Sequence, ...] = ()   # n > 1: fork from seq once its prompt is computed


@dataclass(frozen=True)
class _Fork:
    seq: Sequence
    parent_id: str


@dataclass(frozen=True)
class _Cancel:
    request_id: str


_Message = Union[_Add, _Fork, _Cancel]  # what other threads post to the inbox


@dataclass(frozen=True)
class _Model:
    """The model's part of a step (core.ModelStep): the runner's copies and forward, the sampler's rows."""

    runner: ModelRunner
    sampler: Sampler
    core: EngineCore
    governor: ThreadGovernor | None   # the thread count, where the user left it to the engine
    lender: Lender | None             # one thread fewer while the app's UI borrows a core

    def copy_pages(self, ops) -> None:
        self.runner.copy_pages(ops)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        lending = self.lender is not None and self.lender.lending()
        if self.governor is None or lending:   # the governor compares steps on its own counts only
            return self.runner.execute(plan)
        start = time.perf_counter()
        logits = self.runner.execute(plan)
        self.governor.observe(plan.num_tokens, time.perf_counter() - start)
        return logits

    def sample(self, plan: StepPlan, logits: torch.Tensor) -> list[Sampled | Exception]:
        sampling = [(s.seq, draft) for s in plan.scheduled if s.samples for draft in (*s.draft, None)]
        rows = [Row(seq.params, seq.generator, seq.token_ids, seq.num_prompt_tokens, seq.matcher, draft)
                for seq, draft in sampling]
        return self.sampler(logits, rows, lambda row: self.core.fault(Phase.SAMPLE, sampling[row][0].request_id))


def _threads(device: torch.device, threads: int | None, loan: CoreLoan | None):
    """On the compute thread, whose OpenMP count it is: threads.step_threads, on a CPU."""
    if device.type != "cpu":
        return None, None
    return step_threads(torch.get_num_threads(), threads is not None, torch.set_num_threads, loan)


class Engine:
    """A paged KV-cache LLM engine. See docs/python-api.md."""

    def __init__(self, model=None, *, kv_cache_memory: int | str | None = None, block_size: int = 16,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 swap_space: int | str | None = None, max_tokens_per_step: int = 512, max_seqs: int = 64,
                 threads: int | None = None, progress: Callable[[str, float | None], None] | None = None,
                 autostart: bool = True, fault_hook: FaultHook | None = None, quantize: str | None = None,
                 release_windows: bool = True, kv_cache_dtype: str | torch.dtype | None = None,
                 speculative: str | None = "auto", core_loan: CoreLoan | None = None,
                 step_seconds: float | None = STEP_SECONDS):
        speculative = parse_speculative(speculative)
        folder = resolve_model(model, progress)
        self.model_path = folder
        self.config = ModelConfig.from_folder(folder)
        self.tokenizer = load_tokenizer(folder)
        self.eos_token_ids = frozenset(eos_token_ids(folder, self.config.eos_token_ids, self.tokenizer))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.quantize = parse_quantize(quantize)
        if progress and self.device.type == "cpu" and qmm.needs_build():
            progress("compiling pagedchat's kernels for this machine (once)", None)
        self.dtype = parse_dtype(dtype, self.device, self.quantize is not None or gguf_weights(folder) is not None)
        self.kv_dtype = kv_pages.parse_kv_cache_dtype(kv_cache_dtype)  # the pages' own, not the activations'
        if progress:
            progress("loading weights", None)
        self._compute = ComputeThread("pagedchat-engine", threads)
        try:
            self.model = self._compute.call(self._load_model, folder)
            self.block_size = block_size
            self.cache_plan = plan_cache(self.config, self.kv_dtype, self.device, block_size,
                                         parse_bytes(kv_cache_memory), parse_bytes(swap_space), max_seqs=max_seqs,
                                         max_tokens_per_step=max_tokens_per_step, release_windows=release_windows)
            self.runner = self._compute.call(ModelRunner, self.model, self.cache_plan.groups, block_size,
                                             self.kv_dtype)
        except BaseException:
            self._compute.close()
            raise
        self.weight_bytes = self.model.weight_bytes()  # fixed once loaded; F2 and the bench show it beside the pool
        log.info("%s runs as:\n  %s", folder.name, "\n  ".join(self.model.run_paths().lines()))
        # An engine dropped without shutdown() frees its idle thread. Not at interpreter exit: the thread is a
        # daemon, and a live loop would make close() wait there.
        weakref.finalize(self, self._compute.close, 0).atexit = False
        # One page pool per layer group (sliding-window layers release their passed pages; see page_groups.py).
        self.pages = PageGroups(tuple(BlockManager(g.num_pages, block_size, g.num_cpu_pages, group=i, window=g.window)
                                      for i, g in enumerate(self.cache_plan.groups)),
                                max(max_tokens_per_step, max_seqs))
        # Drafts from each chat's own text, verified in one step (engine/ngram.py): "off" turns it off.
        self.speculation = None if speculative == "off" else Speculation(
            speculative, max_context=self.config.max_position_embeddings)
        timer = None if step_seconds is None else StepTimer(step_seconds)
        self.scheduler = Scheduler(self.pages, max_tokens_per_step, max_seqs, self.speculation, timer)
        self.core = EngineCore(self.pages, self.scheduler, Detokenizer(self.tokenizer), self.eos_token_ids,
                               self.config.max_position_embeddings, fault_hook)
        self.sampler = Sampler(self.eos_token_ids)
        self.governor, lender = self._compute.call(_threads, self.device, threads, core_loan)
        self._model = _Model(self.runner, self.sampler, self.core, self.governor, lender)
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.tokenizer.eos_token_id)
        self.failure: str | None = None          # why the engine stopped, if it could not go on
        self._autostart = autostart
        self._ids = itertools.count()
        self._lock = threading.Lock()           # the core's state, between phases
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}  # every request submitted and not yet ended
        self._stopped = False
        self._looping = False
        self._blameless_faults = 0              # failed steps in a row that failed no request
        if autostart:  # before the first request too: its loop starts after the region in hand
            self._compute.start(self._warm_while_idle)

    def _load_model(self, folder) -> DecoderModel:
        return packed_cache.load_model(folder, self.config, self.device, self.dtype, self.quantize, load_weights)

    @property
    def steps(self) -> int:
        return self.core.steps

    # ---- public API --------------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, *, parse_special: bool = False) -> list[int]:
        """A prompt's token ids, unchecked; chat messages go through the model's chat template
        (engine/chat_template.py, the one path every prompt is built on). A text is plain text, its special tokens'
        text read as text, unless parse_special (a raw prompt whose author writes the template's markers himself).
        A text is tokenized only as far as tells it too long (chat_template.count_limit)."""
        counted = count_limit(self.config.max_position_embeddings) + 1
        if isinstance(prompt, str):
            return encode_up_to(self.tokenizer, prompt, counted, split_special_tokens=not parse_special)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return chat_prompt_ids(self.tokenizer, list(prompt), system_role=self.config.family.system_role,
                                   max_length=counted)
        return [int(t) for t in prompt]

    def encode_prompt(self, prompt: Prompt, *, parse_special: bool = False) -> list[int]:
        """tokenize(prompt), checked against the context and the vocabulary."""
        ids = self.tokenize(prompt, parse_special=parse_special)
        self._validate(ids)
        return ids

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               on_update: Callable[[Update], None] | None = None, request_id: str | None = None) -> RequestHandle:
        """Queue a request; tokens stream to the handle (and on_update, on the engine thread) as they come."""
        return self.submit_many([prompt], params, on_update=on_update, request_ids=[request_id])[0]

    def submit_many(self, prompts: list[Prompt], params: SamplingParams | None = None, *,
                    on_update=None, request_ids: list[str | None] | None = None, n: int = 1) -> list[RequestHandle]:
        """Queue several requests so that they are admitted in the same step. n > 1: n replies to each prompt
        (handles in prompt order, n each), whose prompt is computed once and shared copy-on-write."""
        self._check_running()
        params = params or SamplingParams()
        self._check_params(params)
        if not isinstance(n, int) or n < 1:
            raise RequestError(f"n must be a whole number of at least 1 (got {n!r})")
        encoded = [self.encode_prompt(p) for p in prompts]  # fails before anything is queued
        for ids in encoded:
            self.core.check_fits(ids, params)
        rids = [rid or f"req-{next(self._ids)}" for rid in request_ids or [None] * len(prompts)]
        groups = [[self._new_sequence(ids, params, rid, i) for i in range(n)]
                  for ids, rid in zip(encoded, rids)]
        handles = self._register([seq for group in groups for seq in group], on_update)
        for parent, *siblings in groups:
            self._inbox.put(_Add(parent, tuple(siblings)))
        self._kick()
        return handles

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """A grammar compiled for this model's tokenizer (cached), for SamplingParams.grammar. Call it off the
        engine's thread; raises RequestError naming what is wrong with the grammar or schema."""
        return self.grammars.compile(spec)

    def fork(self, request_id: str, params: SamplingParams | None = None, *,
             on_update: Callable[[Update], None] | None = None) -> RequestHandle:
        """Continue request_id's tokens (prompt and output so far) as a new request.

        A live parent shares all its pages with the child, copy-on-write; a finished one is resumed from the
        prefix cache."""
        self._check_running()
        with self._lock:
            tokens = self.core.tokens_of(request_id)
        if tokens is None:
            raise RequestError(f"no request {request_id!r} to fork")
        params = params or SamplingParams()
        if params.grammar is not None:  # the grammar would start over in the middle of the parent's reply
            raise RequestError("a fork cannot take a grammar")
        self._check_params(params)
        self.core.check_fits(tokens, params)
        seq = self._new_sequence(tokens, params, f"req-{next(self._ids)}")
        [handle] = self._register([seq], on_update)
        self._inbox.put(_Fork(seq, request_id))
        self._kick()
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id))
        self._kick()

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[Outcome]:
        """Run prompts concurrently and wait for all of them."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        handles = self.submit_many(list(prompts), params)
        return [h.result() for h in handles]

    def memory(self) -> MemorySnapshot:
        """A consistent picture of the page pool; safe to call from any thread while the engine runs."""
        with self._lock:
            return snapshot(self.pages, self.scheduler, self.config.max_position_embeddings, self.cache_plan,
                            self.weight_bytes, self.model.weight_precision, kv_pages.name(self.kv_dtype))

    def usage(self) -> PoolUsage:
        """Steps run and pages in use: cheap, for a caller that watches every update (the bench's peak)."""
        with self._lock:
            used = self.pages.pages_used()
            return PoolUsage(self.core.steps, used[0],
                             sum(n * g.page_bytes for n, g in zip(used, self.cache_plan.groups)))

    def has_work(self) -> bool:
        """Requests queued or running: what a caller stepping by hand (autostart=False) steps until done."""
        with self._lock:
            return not self._inbox.empty() or self.core.has_work()

    def shutdown(self) -> None:
        """Stop the engine. Every request in flight or queued ends at once as CANCELLED."""
        self._end_all(FinishReason.CANCELLED, None)
        self._wake.set()
        self._compute.close()

    # ---- validation ----------------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self.failure is not None:
            raise RequestError(f"engine stopped: {self.failure}")
        if self._stopped:
            raise RequestError("the engine has been shut down")

    def _validate(self, ids: list[int]) -> None:
        ctx = self.config.max_position_embeddings
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= ctx:
            raise RequestError(f"the prompt has {prompt_size(len(ids), ctx)} tokens but the model's context holds "
                               f"{ctx}: shorten it or start a new chat")
        self.check_vocabulary(ids)

    def check_vocabulary(self, ids) -> None:
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    def _check_params(self, params: SamplingParams) -> None:
        self.check_vocabulary(params.token_ids_used())

    def _new_sequence(self, ids: list[int], params: SamplingParams, rid: str, sibling: int = 0) -> Sequence:
        """sibling: the index among the n replies to one prompt; a seeded request's siblings take the seeds
        after its own, so that they differ and still repeat (params.sibling_seed)."""
        seq = Sequence(request_id=rid if sibling == 0 else f"{rid}-{sibling}", token_ids=list(ids),
                       num_prompt_tokens=len(ids), params=params, group=rid)
        if not params.greedy:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(sibling_seed(params.seed, sibling) if params.seed is not None else torch.seed())
        if params.grammar is not None:
            seq.matcher = params.grammar.matcher()
        return seq

    def _register(self, seqs: list[Sequence], on_update) -> list[RequestHandle]:
        """Handles for new requests; a request id already queued or running is refused, and then none is."""
        with self._lock:
            self._check_running()
            ids = [s.request_id for s in seqs]
            taken = next((rid for i, rid in enumerate(ids) if rid in self._handles or rid in ids[:i]), None)
            if taken is not None:
                raise RequestError(f"request id {taken!r} is already in use")
            handles = [RequestHandle(s.request_id, list(s.token_ids), self.cancel, on_update, s) for s in seqs]
            self._handles.update((h.request_id, h) for h in handles)
        return handles

    # ---- the loop ----------------------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._autostart and not self._looping:
            with self._lock:
                if not self._looping:
                    self._looping = True
                    self._compute.start(self._loop)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stopped:
                if not self.step() and not self.has_work():
                    self._warm_while_idle()
                    if not self.has_work():
                        self._wake.wait(timeout=0.5)
                        self._wake.clear()
        except BaseException as exc:  # the loop itself broke: say so to every request, never hang one
            log.exception("the engine loop stopped")
            self._end_all(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")

    def _warm_while_idle(self) -> None:
        """On the compute thread, while no request waits: the pool's next pages faulted in, a region at a time
        (engine/pool_warmer.py)."""
        while not (self._stopped or self.has_work()) and self.runner.warm_some():
            pass

    def step(self) -> list[Update]:
        """Inbox, then schedule -> run -> sample -> postprocess (the loop's, or by hand with autostart=False). By
        hand it still runs on the compute thread: stepped on the caller's own, a second OpenMP team would slow
        every step (engine/compute_thread.py). A stopped engine's thread is gone: nothing to step."""
        return [] if self._stopped else self._compute.call(self._step)

    def _step(self) -> list[Update]:
        if self._stopped:
            return []
        with self._lock:
            out = self._drain_inbox()
        try:
            out += self.core.run_step(self._model, self._lock)
            self._blameless_faults = 0
        except Exception as exc:  # a batch phase failed: the core fails the requests it concerns
            out += self._recover(exc)
        return self._deliver(out)

    def _recover(self, exc: Exception) -> list[Output]:
        log.exception("engine step failed in %s", self.core.phase.value)
        with self._lock:
            out = self.core.abort_step(exc)
        self._blameless_faults = 0 if out else self._blameless_faults + 1
        if self._blameless_faults >= MAX_BLAMELESS_FAULTS:
            self._end_all(FinishReason.ERROR, f"{self.core.phase.value} failed {MAX_BLAMELESS_FAULTS} times in a row "
                                   f"({type(exc).__name__}: {exc})")
        return out

    def _drain_inbox(self) -> list[Output]:
        out = []
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return out
            try:
                output = self._apply(msg)
            except Exception as exc:  # fail the request it was about, and only that one
                log.exception("engine could not take %s", msg)
                seq = self.core.sequence(msg.request_id) if isinstance(msg, _Cancel) else msg.seq
                output = self.core.fail(seq, f"{type(exc).__name__}: {exc}") if seq is not None else None
            if output is not None:
                out.append(output)

    def _apply(self, msg: _Message) -> Output | None:
        if isinstance(msg, _Add):
            self.core.add_group(msg.seq, list(msg.siblings))
            return None
        if isinstance(msg, _Fork):
            seq = msg.seq
            output = self.core.fork(seq, msg.parent_id)
            handle = self._handles.get(seq.request_id)
            if handle is not None:  # the child starts from the parent's tokens as they are now
                handle.prompt_token_ids = seq.token_ids[:seq.num_prompt_tokens]
            return output
        return self.core.cancel(msg.request_id)

    def _deliver(self, out: list[Output]) -> list[Update]:
        with self._lock:
            claimed = [(self._handles.pop(seq.request_id, None) if update.finished
                        else self._handles.get(seq.request_id), update) for seq, update in out]
        for handle, update in claimed:  # outside the lock: listeners may call memory()
            if handle is not None:
                handle._deliver(update)
        return [update for _, update in out]

    def _end_all(self, reason: FinishReason, error: str | None) -> None:
        """The engine stops: every request still in flight or queued ends now, with reason."""
        with self._lock:
            if error is not None and self.failure is None:
                self.failure = error
            self._stopped = True
            handles, self._handles = list(self._handles.values()), {}
            finals = [h._final_update(self.core.detokenizer.finish(h._seq)[1], reason,
                                      f"engine stopped: {error}" if error else None) for h in handles]
        for handle, update in zip(handles, finals):  # outside the lock: listeners may call memory()
            handle._end(update)
