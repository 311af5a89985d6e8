"""`pagedchat bench --serve`: what HTTP costs. The bench's workload runs twice on one engine: submitted straight
into it (token ids through the backend face, as the server itself submits them), and through `pagedchat serve`
(in this process, on 127.0.0.1) by 8 streaming HTTP clients.

Both runners see the same warm engine and prefix cache, rounds alternate (other work on a shared machine drifts),
and the medians are compared. The clients run in this process too, so their SSE parsing competes with the
server for the same cores and the GIL: the overhead measured is an upper bound on the server's own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

import httpx
import uvicorn

from pagedchat.backends.base import TokenBackend
from pagedchat.bench.options import write_json
from pagedchat.engine.params import SamplingParams
from pagedchat.serve.routes import create_app

CLIENTS = 8
MODEL_NAME = "bench"


@dataclass(frozen=True)
class Round:
    runner: str            # "engine" or "http"
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class ServeBenchReport:
    clients: int
    max_tokens: int
    system_tokens: int
    rounds: list[Round]

    def median(self, runner: str) -> float:
        return statistics.median(r.tokens_per_s for r in self.rounds if r.runner == runner)

    @property
    def overhead(self) -> float:
        """The share of the engine's own tokens/s that going through HTTP loses."""
        return 1 - self.median("http") / self.median("engine")

    def to_json(self) -> dict:
        return {**asdict(self), "engine_tokens_per_s": self.median("engine"),
                "http_tokens_per_s": self.median("http"), "overhead": self.overhead}


def run_engine_round(backend: TokenBackend, prompts: list[list[int]], params: SamplingParams) -> Round:
    start = time.perf_counter()
    replies = backend.submit_ids(prompts, params)
    tokens = sum(r.result().generated_tokens for r in replies)
    return Round("engine", tokens, time.perf_counter() - start)


async def _stream_one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> int:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def _http_round(url: str, prompts: list[list[int]], max_tokens: int) -> Round:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream_one(http, p, max_tokens) for p in prompts))
        return Round("http", sum(counts), time.perf_counter() - start)


class InProcessServer:
    """`pagedchat serve`'s app over an existing backend, on a thread of its own, on a free loopback port."""

    def __init__(self, backend: TokenBackend):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(lambda: backend, MODEL_NAME)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="pagedchat-serve-bench", daemon=True)

    def __enter__(self) -> "InProcessServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the bench's server did not come up")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True   # its shutdown also shuts the engine down
        self.thread.join(30)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_serve_bench(backend: TokenBackend, prompts: list[list[int]], max_tokens: int, repeat: int,
                    system_tokens: int, progress=_progress) -> ServeBenchReport:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rounds: list[Round] = []
    with InProcessServer(backend) as server:
        run_engine_round(backend, prompts, params)   # warm: first-call costs and the prefix cache, off the clock
        for i in range(repeat):
            for runner in ("engine", "http"):
                r = (run_engine_round(backend, prompts, params) if runner == "engine"
                     else asyncio.run(_http_round(server.url, prompts, max_tokens)))
                progress(f"round {i + 1}/{repeat} {runner:6s} {r.tokens} tokens in {r.seconds:.2f}s = "
                         f"{r.tokens_per_s:.1f} tok/s")
                rounds.append(r)
    return ServeBenchReport(len(prompts), max_tokens, system_tokens, rounds)


def run(args) -> int:
    """The `pagedchat bench --serve` entry point."""
    from pagedchat.backends.local import LocalBackend
    from pagedchat.bench.workload import build_workload
    from pagedchat.config import EngineOptions
    from pagedchat.engine.engine import Engine

    options = EngineOptions(model=args.model, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                            kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
                            device=getattr(args, "device", None), threads=getattr(args, "threads", None))
    engine = Engine(**options.kwargs())
    # The workload is cut from the model's own tokenizer, as `pagedchat bench` cuts it (bench/workload.py).
    prompts = build_workload(engine.tokenizer, args.system_tokens, CLIENTS, args.seed).prompts
    report = run_serve_bench(LocalBackend(engine), prompts, args.max_tokens, args.repeat, args.system_tokens)
    print(f"{CLIENTS} streaming clients, {args.max_tokens} tokens each, {args.system_tokens}-token shared system "
          f"prompt, median of {args.repeat} round(s):")
    print(f"  engine in-process  {report.median('engine'):7.1f} tok/s")
    print(f"  over HTTP (SSE)    {report.median('http'):7.1f} tok/s   overhead {report.overhead:.1%}")
    write_json(args.json_path, report.to_json())
    return 0
