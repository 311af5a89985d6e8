"""`pagedchat bench --flood`: what a flood of `n` costs everyone else. Short requests are sent one after another
through `pagedchat serve` (in this process, on 127.0.0.1), alone and then beside clients that each stream `n`
long replies, rounds alternating; each short request's time to its first token and to its last is kept, and the
table gives their p50 and p99. After each flood the pages must all come back.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from pagedchat.backends.base import TokenBackend
from pagedchat.bench.options import write_json
from pagedchat.bench.http import MODEL_NAME, InProcessServer

FLOODERS = 4        # clients that each ask for FLOOD_N long replies
FLOOD_N = 16
INNOCENTS = 8       # short requests a round, one after another
INNOCENT_TOKENS = 16
SETTLE_S = 30.0     # how long the pages may take to come back once the flood's clients go away


@dataclass(frozen=True)
class Latency:
    beside: str           # "alone" or "flood"
    first_token_s: float
    whole_s: float


@dataclass(frozen=True)
class FloodReport:
    flooders: int
    flood_n: int
    flood_tokens: int
    innocent_tokens: int
    latencies: list[Latency]
    pages_back: bool      # every flood's pages returned to the pool once its clients left

    def quantile(self, beside: str, field: str, q: float) -> float:
        values = sorted(getattr(x, field) for x in self.latencies if x.beside == beside)
        return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 \
            else values[0]

    def rows(self) -> list[tuple[str, float, float, float, float]]:
        return [(beside, *(self.quantile(beside, f, q) for f in ("first_token_s", "whole_s") for q in (0.5, 0.99)))
                for beside in ("alone", "flood")]

    def to_json(self) -> dict:
        return {**asdict(self), "table": [dict(zip(("beside", "first_token_p50_s", "first_token_p99_s",
                                                    "whole_p50_s", "whole_p99_s"), row)) for row in self.rows()]}


async def _innocent(http: httpx.AsyncClient, prompt: list[int]) -> tuple[float, float]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": INNOCENT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
    whole = time.perf_counter() - start
    return (whole if first is None else first), whole


async def _flooder(http: httpx.AsyncClient, prompt: list[int], max_tokens: int, streaming: asyncio.Event) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "n": FLOOD_N, "max_tokens": max_tokens, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            streaming.set()


async def _round(url: str, prompts: list[list[int]], flood_prompt: list[int] | None, flood_tokens: int,
                 beside: str) -> list[Latency]:
    async with httpx.AsyncClient(base_url=url, timeout=None,
                                 limits=httpx.Limits(max_connections=FLOODERS + 1)) as http:
        flooders: list[asyncio.Task] = []
        if flood_prompt is not None:
            streaming = [asyncio.Event() for _ in range(FLOODERS)]
            flooders = [asyncio.create_task(_flooder(http, flood_prompt, flood_tokens, s)) for s in streaming]
            await asyncio.gather(*(s.wait() for s in streaming))
        try:
            latencies = []
            for prompt in prompts:
                latencies.append(Latency(beside, *await _innocent(http, prompt)))
            return latencies
        finally:
            for task in flooders:   # the flood's clients go away: their replies are cancelled
                task.cancel()
            await asyncio.gather(*flooders, return_exceptions=True)


def _pages_back(backend: TokenBackend, free: int) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        snap = backend.memory()
        if not snap.seqs and snap.free_pages == free:
            return True
        time.sleep(0.1)
    return False


def run_flood_bench(backend: TokenBackend, prompts: list[list[int]], flood_prompt: list[int], flood_tokens: int,
                    repeat: int, progress=lambda line: print(line, file=sys.stderr, flush=True)) -> FloodReport:
    latencies: list[Latency] = []
    pages_back = True
    with InProcessServer(backend) as server:
        asyncio.run(_round(server.url, prompts[:1], None, flood_tokens, "warm"))   # first-call costs, off the clock
        free = backend.memory().free_pages
        for i in range(repeat):
            for beside in ("alone", "flood"):
                got = asyncio.run(_round(server.url, prompts, flood_prompt if beside == "flood" else None,
                                         flood_tokens, beside))
                latencies += got
                whole = statistics.median(x.whole_s for x in got)
                progress(f"round {i + 1}/{repeat} {beside:5s} median short request {whole:.2f}s")
                if beside == "flood":
                    pages_back &= _pages_back(backend, free)
    return FloodReport(FLOODERS, FLOOD_N, flood_tokens, INNOCENT_TOKENS, latencies, pages_back)


def render(report: FloodReport) -> str:
    lines = [f"{INNOCENTS} short requests a round ({report.innocent_tokens} tokens each, one after another), alone "
             f"and beside {report.flooders} clients each streaming n={report.flood_n} replies of "
             f"{report.flood_tokens} tokens:",
             f"  {'beside':8s} {'first token p50':>16s} {'p99':>8s} {'whole reply p50':>16s} {'p99':>8s}"]
    for beside, f50, f99, w50, w99 in report.rows():
        lines.append(f"  {beside:8s} {f50:15.2f}s {f99:7.2f}s {w50:15.2f}s {w99:7.2f}s")
    lines.append(f"  every page back after each flood: {'yes' if report.pages_back else 'NO'}")
    return "\n".join(lines)


def run(args) -> int:
    """The `pagedchat bench --flood` entry point."""
    from pagedchat.backends.local import LocalBackend
    from pagedchat.bench.workload import build_workload
    from pagedchat.config import EngineOptions
    from pagedchat.engine.engine import Engine

    options = EngineOptions(model=args.model, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                            device=args.device, threads=args.threads)
    engine = Engine(**options.kwargs())
    workload = build_workload(engine.tokenizer, args.system_tokens, INNOCENTS + 1, args.seed)
    report = run_flood_bench(LocalBackend(engine), workload.prompts[1:], workload.prompts[0], args.max_tokens,
                             args.repeat)
    print(render(report))
    write_json(args.json_path, report.to_json())
    return 0 if report.pages_back else 1
