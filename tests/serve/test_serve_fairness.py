"""A fair share for every request, against a real `pagedchat serve`: floods of n long replies fill the batch and
outgrow the page pool, and requests of one short reply sent beside them still finish within a bound, then
every page comes back once the floods' clients go away."""

from __future__ import annotations

import threading
import time

import httpx

from serve_support import AUTH, start_server
from tiny_models import make_tiny_model

FLOODS = 4          # clients, each asking for N long replies
N = 16
INNOCENTS = 4       # one after another, each while the floods run
INNOCENT_BOUND_S = 15.0   # each innocent request, 16 tokens; the floods alone would run for minutes


def _flood(url: str, stop: threading.Event, started: threading.Barrier) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me everything."}], "n": N, "max_tokens": 1900,
            "temperature": 1.0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            started.wait()
            for _ in response.iter_lines():
                if stop.is_set():
                    return   # the client goes away: its replies are cancelled and their pages freed


def test_requests_beside_floods_of_n_finish_within_a_bound(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", max_positions=2048)
    server = start_server(folder, tmp_path / "server.log", "--max-num-seqs", "32", "--kv-cache-memory", "2MiB")
    stop, started = threading.Event(), threading.Barrier(FLOODS + 1)
    floods = [threading.Thread(target=_flood, args=(server.url, stop, started), daemon=True) for _ in range(FLOODS)]
    try:
        start = server.memory()["snapshot"]
        for thread in floods:
            thread.start()
        started.wait(timeout=60)
        time.sleep(1.0)   # the floods hold the batch
        assert len(server.memory()["snapshot"]["seqs"]) >= 32
        took = []
        for i in range(INNOCENTS):
            t0 = time.monotonic()
            reply = server.http.post("/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"Say hello {i}."}], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True})
            took.append(time.monotonic() - t0)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 16, reply.text
        assert max(took) < INNOCENT_BOUND_S, took
        assert all(thread.is_alive() for thread in floods)   # the floods were still running throughout
        stop.set()
        for thread in floods:
            thread.join(timeout=30)
        deadline = time.monotonic() + 30
        while (snap := server.memory()["snapshot"])["seqs"] or snap["free_pages"] != start["free_pages"]:
            assert time.monotonic() < deadline, (snap["free_pages"], start["free_pages"], list(snap["seqs"]))
            time.sleep(0.1)
    finally:
        stop.set()
        server.stop()
