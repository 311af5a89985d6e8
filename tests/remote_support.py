"""A real `pagedchat serve` process on 127.0.0.1 for the tests of the app over HTTP, bounded in time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class StubOpenAI(BaseHTTPRequestHandler):
    """The plumbing of a stub OpenAI-compatible server: subclasses say what each request gets."""

    def log_message(self, *args) -> None:
        pass

    def json_reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def stream_chat(self, model: str, pieces: list[str]) -> None:
        """pieces as a streamed chat completion ending with "stop", without a usage chunk."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        choices = [{"delta": {"role": "assistant", "content": piece}, "finish_reason": None} for piece in pieces]
        choices.append({"delta": {}, "finish_reason": "stop"})
        for choice in choices:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": [{"index": 0, **choice}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@contextmanager
def stub_server(handler: type[StubOpenAI]):
    """handler served on 127.0.0.1 on a thread; yields its /v1 base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
