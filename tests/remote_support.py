"""A real `pagedchat serve` process on 127.0.0.1 for the tests of the app over HTTP, bounded in time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

START_S = 180.0   # torch, the model and uvicorn, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"
        self._log = open(log, "wb")
        # The command's own entry point, as a user runs it; -c keeps `kernels` off sys.path as pytest's rule asks.
        code = "import sys; from pagedchat.cli import main; sys.exit(main())"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--kv-cache-memory", "4MiB", "--threads", "1"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PAGEDCHAT_API_KEY": ""})
        self.log = log

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-2000:]
                raise RuntimeError(f"pagedchat serve exited with {self.proc.returncode}: {tail}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"pagedchat serve not ready after {START_S:.0f}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """Gone at once, mid-reply: no graceful shutdown, as when a server machine dies."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


@contextmanager
def running_server(model: Path, log_dir: Path, port: int | None = None):
    server = ServerProcess(model, port or free_port(), log_dir / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
