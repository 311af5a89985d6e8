"""A fair share for every request, against a real `pagedchat serve`: floods of n long replies fill the batch and
outgrow the page pool, and requests of one short reply sent beside them still finish within a bound, then
every page comes back once the floods' clients go away."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from serve_support import AUTH, KEY, start_server
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


@pytest.mark.timing
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


OTHER_KEY = "open-sesame"


def _long_stream(url: str, key: str, opened: threading.Event, release: threading.Event, codes: list[int]) -> None:
    body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            codes.append(response.status_code)
            for _ in response.iter_lines():
                opened.set()
                if release.is_set():
                    return


def test_each_key_has_its_own_share_of_open_requests_and_tokens(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", max_positions=2048)
    server = start_server(folder, tmp_path / "server.log", "--api-key", KEY, "--api-key", OTHER_KEY,
                          "--max-requests-per-key", "1", "--max-request-tokens", "2000", "--kv-cache-memory", "4MiB")
    opened, release, codes = threading.Event(), threading.Event(), []
    holder = threading.Thread(target=_long_stream, args=(server.url, KEY, opened, release, codes), daemon=True)
    short = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8}
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    try:
        holder.start()
        assert opened.wait(60), codes
        busy = server.http.post("/v1/chat/completions", json=short)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
        assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        assert server.http.post("/v1/chat/completions", json=short, headers=other).status_code == 200
        assert server.http.get("/v1/models").status_code == 200   # only generation requests count
        release.set()
        holder.join(30)
        assert codes == [200]
        deadline = time.monotonic() + 10
        while (again := server.http.post("/v1/chat/completions", json=short)).status_code == 429:
            assert time.monotonic() < deadline   # the stream's slot is freed once its response ends
            time.sleep(0.1)
        assert again.status_code == 200, again.text

        over = server.http.post("/v1/chat/completions", json={**short, "n": 4, "max_tokens": 501})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens", over.text
        unasked = server.http.post("/v1/chat/completions", json={
            "messages": short["messages"], "n": 16, "ignore_eos": True})
        assert unasked.status_code == 200, unasked.text
        assert [c["finish_reason"] for c in unasked.json()["choices"]] == ["length"] * 16
        assert unasked.json()["usage"]["completion_tokens"] == 2000   # each of the 16 replies got 2000 // 16
    finally:
        release.set()
        server.stop()
