"""The soak test: a real `pagedchat serve` under 32 streaming clients, some innocent, some dropping mid-reply,
some sending hostile settings, with slow sockets beside them. Its plan is drawn once from a fixed seed and it
stops when the plan is done (well within a minute on a 2-core machine).

It holds when no innocent request fails or changes (each gets the text it gets alone), every hostile request is
answered on its own terms (a reply, or a 400 naming its field), /health answers within 200 ms throughout, and
the page pool returns to its starting count."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from enum import Enum

import httpx
import pytest

from serve_support import AUTH, HealthWatch, start_server
from tiny_models import make_tiny_model

CLIENTS = 32
REQUESTS_PER_CLIENT = 32
SLOW_SOCKETS = 200
HEAD_DEADLINE_S = 2
SOAK_LIMIT_S = 60
PROMPTS = ["The quick brown fox", "A page table maps", "Once upon a time", "def fib(n):"]
INNOCENT = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
# Accepted settings at the edges of float32 and of 64-bit seeds: each must get a reply and fail no one else.
HOSTILE = [{"top_p": 7e-46}, {"top_p": 5e-324, "top_k": 2**70}, {"temperature": 1e308},
           {"temperature": 3.4e38, "top_p": 1e-38}, {"temperature": 0.01, "seed": 2**64 - 1},
           {"seed": -2**63, "top_k": 1}, {"repetition_penalty": 1e-38, "logit_bias": {"0": 100}},
           {"frequency_penalty": 2, "presence_penalty": -2, "min_tokens": 24, "n": 3}]
# Refused settings: a 400 naming the field.
REFUSED = [({"seed": 2**64}, "seed"), ({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"),
           ({"max_tokens": 10**9}, "max_tokens"), ({"n": 17}, "n"),
           ({"logit_bias": {"99999999": 5}}, "logit_bias")]


class Kind(Enum):
    INNOCENT = "innocent"
    DROP = "drop"          # reads a few chunks (or none), then disconnects
    HOSTILE = "hostile"
    REFUSED = "refused"


@dataclass(frozen=True)
class Planned:
    kind: Kind
    prompt: str
    extra: dict = field(default_factory=dict)
    drop_after: int = 0
    param: str | None = None


def draw_plan(rng: random.Random) -> list[list[Planned]]:
    def one() -> Planned:
        kind = rng.choice([Kind.INNOCENT, Kind.INNOCENT, Kind.DROP, Kind.HOSTILE, Kind.REFUSED])
        prompt = rng.choice(PROMPTS)
        if kind is Kind.HOSTILE:
            return Planned(kind, prompt, {"temperature": 1.0, **rng.choice(HOSTILE), "max_tokens": 24})
        if kind is Kind.REFUSED:
            extra, param = rng.choice(REFUSED)
            return Planned(kind, prompt, extra, param=param)
        return Planned(kind, prompt, drop_after=rng.randint(0, 8))

    return [[one() for _ in range(REQUESTS_PER_CLIENT)] for _ in range(CLIENTS)]


def events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def run(http: httpx.AsyncClient, p: Planned, alone: dict[str, str]) -> None:
    body = {"prompt": p.prompt, "stream": True, **(INNOCENT if p.kind is not Kind.HOSTILE else {}), **p.extra}
    if p.kind is Kind.DROP:
        body["max_tokens"] = 400
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if p.kind is Kind.REFUSED:
            await response.aread()
            assert response.status_code == 400, (p, response.text)
            assert response.json()["error"]["param"] == p.param, (p, response.text)
            return
        assert response.status_code == 200, (p, await response.aread())
        lines = []
        async for line in response.aiter_lines():
            lines.append(line)
            if p.kind is Kind.DROP and sum(x.startswith("data: ") for x in lines) > p.drop_after:
                return   # leaving the block closes the connection mid-reply
    got = events(lines)
    assert got[-1] == "[DONE]", (p, lines[-3:])
    final = got[-2]["choices"][0]
    assert final["finish_reason"] in ("length", "stop"), (p, got[-2])
    if p.kind is Kind.INNOCENT:
        text = "".join(e["choices"][0]["text"] for e in got[:-1])
        assert text == alone[p.prompt], p


class SlowSockets:
    """Sockets that send a request head a byte at a time, never finishing it; each one the server closes is
    opened again, so the pressure lasts as long as the soak."""

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _open(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.setblocking(False)
        return s

    def _run(self) -> None:
        socks = [self._open() for _ in range(self.n)]
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
        sent = 0
        while not self._stop.wait(0.5):
            for i, s in enumerate(socks):
                try:
                    s.send(head[sent % len(head):sent % len(head) + 1])
                    if s.recv(1) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    s.close()
                    socks[i] = self._open()
                    self.reopened += 1
            sent += 1
        for s in socks:
            s.close()

    def __enter__(self) -> "SlowSockets":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("soak") / "tiny", max_positions=2048)
    running = start_server(folder, tmp_path_factory.mktemp("soak-log") / "server.log",
                           "--timeout-keep-alive", str(HEAD_DEADLINE_S), env={"PAGEDCHAT_API_KEY": "sesame"})
    yield running
    running.stop()


@pytest.mark.timing
@pytest.mark.slow  # a minute of 32 clients: the fast run has the serve tests' one-client-at-a-time cases
def test_soak(server):
    alone = {}
    for prompt in PROMPTS:
        reply = server.http.post("/v1/completions", json={"prompt": prompt, **INNOCENT}).json()
        alone[prompt] = reply["choices"][0]["text"]
    start = server.memory()["snapshot"]
    plan = draw_plan(random.Random(21))

    async def client(http: httpx.AsyncClient, requests: list[Planned]) -> None:
        for p in requests:
            await run(http, p, alone)

    async def soak() -> None:
        limits = httpx.Limits(max_connections=CLIENTS * 2)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30, limits=limits) as http:
            await asyncio.wait_for(asyncio.gather(*(client(http, r) for r in plan)), SOAK_LIMIT_S)

    started = time.monotonic()
    with HealthWatch(server.url) as health, SlowSockets(int(server.url.rsplit(":", 1)[1]), SLOW_SOCKETS) as slow:
        asyncio.run(soak())
    took = time.monotonic() - started
    # A blocked event loop stalls every probe for seconds; one probe late by a few hundred ms is the scheduler of
    # a shared 2-core machine, so the bound is on nearly every probe, and a looser one on all of them.
    latencies = sorted(health.latencies)
    assert health.codes == {200} and latencies[int(len(latencies) * 0.95)] < 0.2 and latencies[-1] < 1.0, \
        latencies[-5:]
    assert HEAD_DEADLINE_S * 3 < took < SOAK_LIMIT_S
    assert slow.reopened >= SLOW_SOCKETS, "the server closes sockets that never finish a request head"
    assert {p.kind for requests in plan for p in requests} == set(Kind)
    deadline = time.monotonic() + 5
    while (snap := server.memory()["snapshot"])["seqs"] or snap["free_pages"] != start["free_pages"]:
        assert time.monotonic() < deadline, (snap["free_pages"], start["free_pages"], list(snap["seqs"]))
        time.sleep(0.05)
    assert snap["free_pages"] == snap["num_pages"] and not snap["ref_counts"]
    assert "Traceback" not in server.log.read_text()
