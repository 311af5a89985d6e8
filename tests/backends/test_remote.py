"""The app and its HTTP client over a real `pagedchat serve` process on 127.0.0.1, on a tiny model.

Nothing of our own server is mocked: the client streams real SSE, cancels by closing real connections, reads
the server's real /v1/memory, and a real process is killed under it mid-reply.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import httpx
import pytest
import textual.app
import textual.pilot
from textual._wait import wait_for_idle

from pagedchat.backends.base import Backend, MemoryUnavailable
from pagedchat.backends.remote import RemoteBackend, ServerUnavailable, api_base, server_root
from pagedchat.engine.kv_snapshot import MemorySnapshot
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.records import ReplyHandle
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.inspector import InspectorView
from pagedchat.tui.conversation import ChatSettings
from pagedchat.tui.store import Store
from remote_support import StubOpenAI, free_port, running_server, stub_server
from tiny_models import make_tiny_model
from tui_support import make_config, notices, send, static_text, wait_for

SIZE = (100, 32)
LONG = 4000   # tokens: long enough to be stopped, forked or killed mid-way on a fast machine; the tests end them
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("remote-model"), seed=1, max_positions=4096)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_server(model, tmp_path_factory.mktemp("serve-log")) as server:
        yield server


@pytest.fixture(autouse=True)
def _quick_pilot(monkeypatch):
    """As in test_tui: the tests wait on explicit conditions, so Pilot's idle wait is capped."""
    quick = partial(wait_for_idle, max_sleep=0.05)
    monkeypatch.setattr(textual.app, "wait_for_idle", quick)
    monkeypatch.setattr(textual.pilot, "wait_for_idle", quick)


def server_seqs(server) -> dict:
    return httpx.get(server.url + "/memory", timeout=5).json()["snapshot"]["seqs"]


def test_client_streams_forks_and_cancels(server):
    backend = RemoteBackend(server.url)
    try:
        assert isinstance(backend, Backend)
        info = backend.info
        assert info.where == f"via {server.url}" and info.context_length == 4096
        assert info.block_size == 16 and info.num_pages and info.page_bytes

        updates = []
        handle = backend.submit(HI, SamplingParams(max_tokens=12), on_update=updates.append)
        assert isinstance(handle, ReplyHandle)   # the one face of a reply in flight, as the engine's own
        first = handle.result(120)
        assert first.finish_reason == "length" and first.generated_tokens == 12 and first.prompt_tokens > 16
        assert first.text == "".join(u.text for u in updates) and updates[-1].outcome == first
        # The same prompt again comes from the server's prefix cache, as usage.cached_tokens says.
        again = backend.submit(HI, SamplingParams(max_tokens=4)).result(120)
        assert again.cached_tokens >= first.prompt_tokens // 16 * 16 - 16 > 0

        # A fork continues the live reply: its first update carries the text it inherits, and the server
        # computes only what follows (continue_final_message), the rest from the prefix cache.
        parent_updates, child_updates = [], []
        parent = backend.submit(HI, SamplingParams(max_tokens=LONG), on_update=parent_updates.append)
        wait_until(lambda: parent.text, "the parent's first tokens")
        child = backend.fork(parent, SamplingParams(max_tokens=6), on_update=child_updates.append)
        done = child.result(120)
        inherited = child_updates[0].inherited
        assert inherited and parent.text.startswith(inherited) and done.generated_tokens == 6
        assert done.prompt_tokens > first.prompt_tokens and done.cached_tokens > 0

        # The server keys its memory by the response id; the client reports it by its own handle id.
        wait_until(lambda: parent.request_id in getattr(backend.memory(), "seqs", {}), "the parent in /v1/memory")
        assert parent.server_id in server_seqs(server)
        parent.cancel()  # closes the stream: the server cancels the request and frees its pages
        assert parent.result(30).finish_reason == "cancelled" and parent.result().text == parent.text
        wait_until(lambda: parent.server_id not in server_seqs(server), "the server to drop the request")
    finally:
        backend.shutdown()


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_urls_name_the_api_base_and_the_metrics_root():
    assert api_base("http://gpu-box:8000") == "http://gpu-box:8000/v1"
    assert api_base(" http://gpu-box:8000/v1/ ") == "http://gpu-box:8000/v1"
    assert api_base("https://example.org/api/v1") == "https://example.org/api/v1"
    assert server_root("http://gpu-box:8000/v1") == "http://gpu-box:8000"


def test_client_names_a_server_that_is_not_there():
    port = free_port()
    with pytest.raises(ServerUnavailable, match=rf"Cannot reach the server at http://127.0.0.1:{port}/v1"):
        RemoteBackend(f"http://127.0.0.1:{port}")
    with pytest.raises(ServerUnavailable, match="give an http"):
        RemoteBackend("127.0.0.1:8000")


async def ready(pilot) -> PagedChatApp:
    app = pilot.app
    await wait_for(pilot, lambda: app.backend is not None or app.link.error, "the server", timeout=120)
    assert app.backend is not None, app.link.error
    return app


async def test_app_over_the_server(server, tmp_path):
    app = PagedChatApp(make_config(tmp_path, server=server.url))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert f"via {server.url}" in static_text(app, "#status")
        await pilot.press("f2")
        first = await send(pilot, "first chat", max_tokens=LONG)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_session is not first, "a new tab")
        second = await send(pilot, "second chat", max_tokens=LONG)
        # Both generate at once, on the server, each owning its pages there under the app's request ids.
        await wait_for(pilot, lambda: first.reply.tokens > 3 and second.reply.tokens > 3, "both streaming",
                       timeout=120)
        assert len(server_seqs(server)) == 2
        await wait_for(pilot, lambda: first.pages and second.pages, "each chat's pages from /v1/memory", timeout=60)
        inspector = app.query_one(InspectorView)
        await wait_for(pilot, lambda: isinstance(inspector.last_snapshot, MemorySnapshot)
                       and len(inspector.last_snapshot.seqs) == 2, "the server's page map in F2", timeout=60)
        snap = inspector.last_snapshot
        summary = static_text(app, "#insp-summary")
        free, total = map(int, re.search(r"free pages\s+(\d+) / (\d+)", summary).groups())
        assert total == snap.num_pages == app.backend.info.num_pages and free < total
        assert re.search(r"running\s+\d+ tok\s+\d+ pg", static_text(app, "#insp-chats"))
        table = static_text(app, "#insp-table")
        assert f"{second.pages[0]:>5}" in table  # the chat in view: its block table, with the server's pages

        await pilot.press("escape")  # stops the chat in view: the stream closes and the server cancels it
        await wait_for(pilot, lambda: not second.busy, "the stop", timeout=60)
        assert second.record.messages[-1].stats.finish_reason == "cancelled" and first.busy
        first.reply.handle.cancel()
        await wait_for(pilot, lambda: not first.busy, "the first chat to stop", timeout=60)
        await wait_for(pilot, lambda: not server_seqs(server), "the server to free both", timeout=60)

        # Regenerate asks the server again; the reply finishes with the server's usage figures.
        second.record.settings = replace(second.record.settings, max_tokens=8)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not second.busy and second.record.messages[-1].stats.finish_reason != "cancelled",
                       "the regenerated reply", timeout=120)
        stats = second.record.messages[-1].stats
        assert stats.finish_reason == "length" and stats.generated_tokens == 8 and stats.prompt_tokens > 0


async def test_server_gone_mid_reply_keeps_the_text_and_regenerate_retries(model, tmp_path):
    port = free_port()
    with running_server(model, tmp_path, port) as server:
        app = PagedChatApp(make_config(tmp_path, server=server.url))
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            session = await send(pilot, "tell me a long story", max_tokens=LONG)
            await wait_for(pilot, lambda: session.reply.tokens > 3, "the first tokens", timeout=120)
            server.kill()
            await wait_for(pilot, lambda: not session.busy, "the reply to end", timeout=60)
            reply = session.record.messages[-1]
            assert reply.role == "assistant" and reply.content and reply.stats.finish_reason == "error"
            assert "went away mid-reply" in reply.stats.error
            said = notices(app)
            assert any("went away mid-reply" in n and "text so far is kept" in n for n in said), said
            [saved] = Store.open(app.config.data_dir).load_chats()
            assert saved.messages[-1].content == reply.content  # the partial reply is on disk
            await wait_for(pilot, lambda: isinstance(app.backend.memory(), MemoryUnavailable), "F2's view to say so")

            # Asked again with the server still down: a clear error, the chat as it was.
            await pilot.press("ctrl+r")  # (refused at once: too quick to see the chat busy)
            await wait_for(pilot, lambda: any("could not be reached" in n for n in notices(app)),
                           "the retry to fail", timeout=60)
            await wait_for(pilot, lambda: not session.busy, "the chat idle again")
            failed = session.record.messages[-1]   # kept, marked: the next message is not a second question in a row
            assert failed.role == "assistant" and not failed.content and failed.stats.finish_reason == "error"

            # The server back on the same address: regenerate works again.
            with running_server(model, tmp_path, port):
                session.record.settings = replace(session.record.settings, max_tokens=6)
                await pilot.press("ctrl+r")
                await wait_for(pilot, lambda: session.record.messages[-1].stats is not None and not session.busy,
                               "the new reply", timeout=120)
                stats = session.record.messages[-1].stats
                assert stats.finish_reason == "length" and stats.generated_tokens == 6


async def test_server_down_at_start_is_a_status_line_and_send_retries(model, tmp_path):
    port = free_port()
    app = PagedChatApp(make_config(tmp_path, server=f"http://127.0.0.1:{port}/v1"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.link.error, "the connection error")
        assert f"Cannot reach the server at http://127.0.0.1:{port}/v1" in static_text(app, "#status")
        prompt = app.chat_view(app.active_session).prompt
        prompt.text = "hello"
        await pilot.press("enter")
        assert not app.active_session.record.messages and prompt.text == "hello"  # kept, not sent
        assert any("Trying again" in n for n in notices(app))
        await wait_for(pilot, lambda: app.link.error, "the retry to fail again")
        # The server comes up: the app connects in the background, and the next Enter sends (it used to show
        # the stale "Cannot reach" and send nothing).
        with running_server(model, tmp_path, port):
            await wait_for(pilot, lambda: app.backend is not None, "the reconnect", timeout=120)
            said = len(notices(app))
            session = await send(pilot, "hello", max_tokens=4)
            assert [m.role for m in session.record.messages[:1]] == ["user"]
            assert not any("Cannot reach" in n for n in notices(app)[said:])
            await wait_for(pilot, lambda: not session.busy, "the reply", timeout=120)


def test_server_continues_a_final_assistant_message_when_asked(server):
    """continue_final_message leaves the last (assistant) message open: no end of turn and no new assistant
    header, so the prompt is shorter than the same chat answered after that message."""
    chat = HI + [{"role": "assistant", "content": "Hello! Pages are"}]

    def prompt_tokens(**extra) -> int:
        body = {"messages": chat, "max_tokens": 1, "temperature": 0, **extra}
        response = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(continue_final_message=True, add_generation_prompt=False) < prompt_tokens()
    refused = httpx.post(server.url + "/chat/completions", timeout=60,
                         json={"messages": HI, "max_tokens": 1, "continue_final_message": True,
                               "add_generation_prompt": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


# The request fields OpenAI's chat completions take (of those the app sends); a strict server refuses the rest.
OPENAI_FIELDS = {"model", "messages", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
                 "stop", "presence_penalty", "frequency_penalty"}


class StrictServer(StubOpenAI):
    """An OpenAI-like server that refuses fields it does not know, as OpenAI does; it keeps each body it got."""

    bodies: list[dict] = []

    def do_GET(self) -> None:
        self.json_reply(200, {"object": "list", "data": [{"id": "strict", "object": "model"}]})

    def do_POST(self) -> None:
        body = self.read_body()
        self.bodies.append(body)
        unknown = sorted(set(body) - OPENAI_FIELDS)
        if unknown:
            self.json_reply(400, {"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                            "type": "invalid_request_error", "param": None, "code": None}})
            return
        self.stream_chat("strict", ["Hi."])


@contextmanager
def strict_server():
    StrictServer.bodies = []
    with stub_server(StrictServer) as url:
        yield url, StrictServer.bodies


def test_a_default_chat_sends_only_openai_fields_and_the_others_only_when_set():
    """OpenAI's names always (a strict server takes a default chat); vLLM's extras only when not default."""
    with strict_server() as (url, bodies):
        backend = RemoteBackend(url)
        try:
            plain = ChatSettings(presence_penalty=0.5, frequency_penalty=-0.25, seed=9).params()
            done = backend.submit(HI, plain).result(30)
            assert done.error is None and done.finish_reason == "stop"
            assert {k: bodies[-1][k] for k in ("presence_penalty", "frequency_penalty", "seed", "temperature",
                                               "top_p", "max_tokens")} == \
                {"presence_penalty": 0.5, "frequency_penalty": -0.25, "seed": 9, "temperature": 0.7, "top_p": 0.95,
                 "max_tokens": 1024}
            assert not {"repetition_penalty", "min_tokens", "top_k"} & set(bodies[-1])

            extras = ChatSettings(repetition_penalty=1.2, min_tokens=3, top_k=40).params()
            done = backend.submit(HI, extras).result(30)
            assert {k: bodies[-1][k] for k in ("repetition_penalty", "min_tokens", "top_k")} == \
                {"repetition_penalty": 1.2, "min_tokens": 3, "top_k": 40}
            # the strict server's refusal names the field: the reply says why instead of ignoring it
            assert done.finish_reason == "error" and "min_tokens" in done.error and "400" in done.error
        finally:
            backend.shutdown()


def test_penalties_reach_pagedchat_serve(server):
    """The chat's penalties and min_tokens, sent by the app's client, are what `pagedchat serve` generates
    with: the same reply as the same fields sent by hand, and not the reply without them."""
    fields = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=3.0, min_tokens=12)

    def by_hand(**extra) -> str:
        body = {"messages": HI, "max_tokens": 12, "temperature": 0, **extra}
        response = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    backend = RemoteBackend(server.url)
    try:
        done = backend.submit(HI, ChatSettings(max_tokens=12, temperature=0.0, **fields).params()).result(60)
    finally:
        backend.shutdown()
    assert done.error is None and done.generated_tokens == 12
    assert done.text == by_hand(**fields) != by_hand()
