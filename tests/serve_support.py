"""A real `pagedchat serve` subprocess on 127.0.0.1 for the serve tests: started, waited for, stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

CONTEXT = 2048
# 1 MiB holds 85 float32 pages of this model (1360 tokens): less than the context, so "too big for the cache"
# exists.
CACHE = "1MiB"
STARTUP_S = 120
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class RunningServer:
    proc: subprocess.Popen
    url: str
    model: str
    health_codes: list[int]   # /health answers seen while starting, in order
    log: Path
    http: httpx.Client        # sends the API key

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def memory(self) -> dict:
        return self.http.get("/v1/memory").json()

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, log: Path, *extra: str, env: dict | None = None) -> RunningServer:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedchat.cli", "serve", "--model", str(folder), "--port", str(port),
           "--kv-cache-memory", CACHE, "--dtype", "float32", "--kv-cache-dtype", "float32", "--threads", "1",
           *extra]
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    server = RunningServer(proc, url, str(folder), [], log, httpx.Client(base_url=url, headers=AUTH, timeout=30))
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedchat serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            code = httpx.get(f"{server.url}/health", timeout=2).status_code
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        server.health_codes.append(code)
        if code == 200:
            return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"pagedchat serve not ready after {STARTUP_S}s:\n{log.read_text()}")


class HealthWatch:
    """/health polled every 50 ms on a thread, each answer's latency kept."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.codes: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                self.codes.add(http.get(f"{self.url}/health").status_code)
                self.latencies.append(time.perf_counter() - started)
                self._stop.wait(0.05)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
