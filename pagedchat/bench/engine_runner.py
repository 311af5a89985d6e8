"""pagedchat's side of the bench: the workload on the engine through its backend face (token ids in, updates
out), with the peak page snapshot and a cold against a warm first token."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pagedchat.backends.base import TokenBackend
from pagedchat.bench.options import BenchConfig, BenchError
from pagedchat.bench.capacity import PeakAccounting, Sharing, peak_accounting
from pagedchat.bench.stats import RunStats, median, timing_stats
from pagedchat.bench.workload import WARM_QUESTION, Workload
from pagedchat.engine.records import FinishReason

WARM_REPEATS = 3


def engine_kwargs(cfg: BenchConfig, max_chats: int) -> dict:
    """Engine's keyword arguments for this run (the model included): also what the startup probe's fresh process
    is given."""
    return {**cfg.engine.kwargs(), "max_seqs": max(64, max_chats)}


def new_engine(cfg: BenchConfig, max_chats: int, describe: Callable[[str], None]):
    """The engine measured: the harness reads the model it runs (its config, tokenizer, weights) from it, and
    drives it through the backend face (LocalBackend), as `pagedchat serve` does."""
    from pagedchat.engine.engine import Engine

    describe("loading the engine")
    engine = Engine(**engine_kwargs(cfg, max_chats))
    if engine.model.huge_pages is not None:  # what a moment's idling gives a user's engine, before any timing
        engine.model.huge_pages.finish()
    return engine


def warm_up(backend: TokenBackend, work: Workload) -> None:
    """One short request on a prompt that shares no page with the workload: first-call costs off the clock."""
    from pagedchat.engine.params import SamplingParams

    [reply] = backend.submit_ids([work.cold_prefix(0)], SamplingParams(max_tokens=2, ignore_eos=True))
    reply.result()


@dataclass(frozen=True)
class EngineRun:
    stats: RunStats
    peak: PeakAccounting
    sharing: Sharing


class _Peak:
    """The memory snapshot at the fullest step. A snapshot of a large pool costs milliseconds of engine time:
    take one when the page count grows, and in the last steps before replies end, where the most tokens fill
    the most pages; at most one a step."""

    def __init__(self, backend: TokenBackend):
        self.backend = backend
        self.step = -1
        self.used = -1
        self.snap = None

    def watch(self, ending: bool) -> None:  # on the engine thread, between steps
        usage = self.backend.usage()
        if usage.steps == self.step:
            return
        self.step = usage.steps
        if usage.pages_used > self.used or (usage.pages_used == self.used and ending):
            self.used = usage.pages_used
            self.snap = self.backend.memory()


def run_engine_level(backend: TokenBackend, prompts: list[list[int]], max_tokens: int, progress,
                     tag: str) -> EngineRun:
    """All prompts submitted at once; per-token arrival times, and pages at the peak."""
    from pagedchat.engine.params import SamplingParams

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    arrivals: list[list[float]] = [[] for _ in prompts]
    peak = _Peak(backend)

    def on_update(update) -> None:  # on the engine thread, between steps
        now = time.perf_counter()
        got = arrivals[index[update.request_id]]
        got.extend([now] * update.tokens)
        progress.advance(update.tokens)
        if not update.finished:
            peak.watch(ending=len(got) >= max_tokens - 1)

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    replies = backend.submit_ids(prompts, params, on_update=on_update, request_ids=ids)
    outcomes = [r.result() for r in replies]
    bad = [o for o in outcomes if o.finish_reason is not FinishReason.LENGTH]
    if bad:
        raise BenchError(f"request {bad[0].request_id} ended with {bad[0].finish_reason}"
                         f"{': ' + bad[0].error if bad[0].error else ''}")
    acct = peak_accounting(peak.snap, backend.info.context_length)
    sharing = Sharing(pages_with=acct.pages_with_sharing, pages_without=acct.pages_without_sharing,
                      pages_saved=acct.pages_saved, prompt_tokens=sum(len(p) for p in prompts),
                      prefill_tokens_computed=sum(o.prefilled_tokens for o in outcomes),
                      prefill_tokens_saved=sum(o.cached_tokens for o in outcomes))
    return EngineRun(timing_stats(start, arrivals), acct, sharing)


@dataclass(frozen=True)
class ColdWarm:
    """A new chat alone: its system prompt already cached (warm) against one the cache has never seen (cold)."""

    repeats: int
    prompt_tokens: int
    warm_cached_tokens: int
    cold_s: float
    warm_s: float
    warm_over_cold: float
    cold_all_s: tuple[float, ...]
    warm_all_s: tuple[float, ...]


def cold_prompts(work: Workload) -> list[tuple[list[int], list[int]]]:
    """(cold prefix, user turn) per repeat: a question no chat asked, different from its first token on, so only
    the system prompt can be cached; cold and warm get the same user turn, so only the prefix differs. Every
    runner's cold first token is timed on these same prompts."""
    return [(work.cold_prefix(100 + k), work.user_turn(f"Ticket {k + 1}: {WARM_QUESTION}"))
            for k in range(WARM_REPEATS)]


def ttft_cold_warm(backend: TokenBackend, work: Workload, progress) -> ColdWarm:
    from pagedchat.engine.params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    cold, warm, cached = [], [], []
    for k, (cold_prefix, question) in enumerate(cold_prompts(work)):
        for kind, prefix in (("cold", cold_prefix), ("warm", work.system_ids)):
            t0 = time.perf_counter()
            got = []
            [reply] = backend.submit_ids([prefix + question], params, request_ids=[f"ttft-{kind}-{k}"],
                                         on_update=lambda u: got.append(time.perf_counter()) if u.tokens else None)
            c = reply.result()
            (cold if kind == "cold" else warm).append(got[0] - t0)
            if kind == "warm":
                cached.append(c.cached_tokens)
            progress.advance(1)
    c50, w50 = median(cold), median(warm)
    return ColdWarm(repeats=WARM_REPEATS, prompt_tokens=len(work.system_ids) + len(question),
                    warm_cached_tokens=cached[0], cold_s=c50, warm_s=w50, warm_over_cold=w50 / c50,
                    cold_all_s=tuple(cold), warm_all_s=tuple(warm))
