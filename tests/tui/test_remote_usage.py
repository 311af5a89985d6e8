"""A server that streams no usage (a plain OpenAI-compatible server asked without stream_options, or one that
ignores them): the reply's line says its tokens were not reported instead of showing "prompt 0 · cached 0"."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.store import Store
from tui_support import make_config, quick_pilot, send, static_text, wait_for  # noqa: F401 (autouse)

PIECES = ["Mount ", "Everest", "."]


class NoUsageServer(BaseHTTPRequestHandler):
    """/v1/models and a streamed /v1/chat/completions with no usage chunk; nothing else."""

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "plain", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not here"}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"delta": {"role": "assistant", "content": piece}, "finish_reason": None} for piece in PIECES]
        chunks.append({"delta": {}, "finish_reason": "stop"})
        for choice in chunks:
            body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "plain",
                    "choices": [{"index": 0, **choice}]}
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@contextmanager
def no_usage_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoUsageServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


async def test_a_reply_without_usage_says_its_tokens_were_not_reported(tmp_path):
    with no_usage_server() as url:
        app = PagedChatApp(make_config(tmp_path, server=url))
        async with app.run_test(size=(110, 32)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None, "the connection")
            session = await send(pilot, "Name a mountain.")
            await wait_for(pilot, lambda: not session.busy and len(session.record.messages) == 2, "the reply")
            reply = session.record.messages[-1]
            assert reply.content == "".join(PIECES) and not reply.stats.counted
            line = static_text(app, ".message.-assistant .stats")
            assert line.startswith("tokens not reported · 3 pieces streamed") and "prompt 0" not in line, line
    [saved] = Store.open(tmp_path / "data").load_chats()
    assert not saved.messages[-1].stats.counted   # and so after a restart
