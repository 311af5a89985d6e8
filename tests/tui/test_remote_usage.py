"""A server that streams no usage (a plain OpenAI-compatible server asked without stream_options, or one that
ignores them): the reply's line says its tokens were not reported instead of showing "prompt 0 · cached 0"."""

from __future__ import annotations

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.store import Store
from remote_support import StubOpenAI, stub_server
from tui_support import make_config, quick_pilot, send, static_text, wait_for  # noqa: F401 (autouse)

PIECES = ["Mount ", "Everest", "."]


class NoUsageServer(StubOpenAI):
    """/v1/models and a streamed /v1/chat/completions with no usage chunk; nothing else."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.json_reply(200, {"object": "list", "data": [{"id": "plain", "object": "model"}]})
        else:
            self.json_reply(404, {"error": {"message": "not here"}})

    def do_POST(self) -> None:
        self.read_body()
        self.stream_chat("plain", PIECES)


async def test_a_reply_without_usage_says_its_tokens_were_not_reported(tmp_path):
    with stub_server(NoUsageServer) as url:
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
