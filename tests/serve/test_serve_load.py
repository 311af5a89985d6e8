"""`pagedchat serve` under load that costs its clients little: a prompt of megabytes, hundreds of sockets that
never finish a request, a process out of file descriptors. The event loop must go on answering /health and
streaming everyone else's tokens."""

from __future__ import annotations

import resource
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_support import AUTH, HealthWatch, start_server
from tiny_models import make_tiny_model

HEAD_DEADLINE_S = 2      # --timeout-keep-alive: a connection's time to send a whole request head
HEALTH_BUDGET_S = 0.2
SLOW_SOCKETS = 500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("load") / "tiny", max_positions=2048)
    running = start_server(folder, tmp_path_factory.mktemp("load-log") / "server.log", "--max-body-size", "8MiB",
                           "--timeout-keep-alive", str(HEAD_DEADLINE_S), env={"PAGEDCHAT_API_KEY": "sesame"})
    yield running
    running.stop()


def stream_pace(url: str, max_tokens: int = 200) -> float:
    """A stream's seconds a chunk, from its first chunk to its last. The mean, not each gap: chunks that reach
    the client together are microseconds apart, so single gaps measure the client's reads, not the server's
    pace."""
    body = {"prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1)


def open_slow_sockets(port: int, n: int) -> list[socket.socket]:
    """Sockets that start a request head and never end it."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def big_prompts(http: httpx.Client, until: float) -> list[httpx.Response]:
    """2 MiB prompts, as text and as a chat message, one after another until `until`."""
    text = "the quick brown fox jumps over the lazy dog " * (2 * 2**20 // 44)
    answers = []
    while time.monotonic() < until:
        answers.append(http.post("/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=120))
        answers.append(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]},
                                 timeout=120))
    return answers


@pytest.mark.timing
def test_large_prompts_and_slow_sockets_leave_health_and_a_stream_responsive(server):
    """For 3 s, 2 MiB prompts one after another (tokenized on a worker thread, only as far as tells them too
    long for the context, then refused) and 500 sockets that never finish a request head. /health answers
    within 200 ms throughout, a concurrent stream keeps its pace, and the server closes the slow sockets at the
    deadline."""
    port = int(server.url.rsplit(":", 1)[1])
    normal = statistics.median(stream_pace(server.url) for _ in range(3))
    during: list[float] = []
    load_over = threading.Event()

    def keep_streaming() -> None:
        while not load_over.is_set():
            during.append(stream_pace(server.url))

    streamer = threading.Thread(target=keep_streaming)
    opened = time.monotonic()
    slow = open_slow_sockets(port, SLOW_SOCKETS)
    with HealthWatch(server.url) as health:
        streamer.start()
        answers = big_prompts(server.http, time.monotonic() + 3)
        load_over.set()
        streamer.join()
    for big in answers:
        assert big.status_code == 400 and "more than 8192 tokens" in big.json()["error"]["message"], big.text
    assert health.codes == {200} and len(health.latencies) >= 20
    assert max(health.latencies) < HEALTH_BUDGET_S, sorted(health.latencies)[-5:]
    assert statistics.median(during) < 2 * normal, (normal, statistics.median(during))
    left = max(0.0, opened + HEAD_DEADLINE_S + 2 - time.monotonic())
    assert all(closed_by_server(s, left + 0.5) for s in slow), "a socket with no whole request head is still open"
    for s in slow:
        s.close()


def test_running_out_of_file_descriptors_is_logged_once_and_the_server_recovers(server):
    """The process's descriptor limit is lowered to what it has open plus a few, then 60 sockets connect:
    accept() fails with EMFILE, which asyncio retries (and reported) every second. The log says it once; once the
    server has closed the idle sockets at their deadline, /health answers again."""
    pid = server.proc.pid
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 8, before[1]))
    try:
        socks = [socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) for _ in range(60)]
        time.sleep(3.5)
        for s in socks:
            s.close()
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, before)
    deadline = time.monotonic() + HEAD_DEADLINE_S + 5
    while True:
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server does not answer after running out of descriptors"
        time.sleep(0.1)
    log = server.log.read_text()
    assert log.count("out of system resource") == 1, log[-3000:]
