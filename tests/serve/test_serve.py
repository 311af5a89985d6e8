"""`pagedchat serve` as a real subprocess on 127.0.0.1, on a tiny model, driven by the official openai client
and by httpx. One server for the module (starting one costs seconds), with an API key so that every test goes
through the key check; the SIGTERM test stops it, so it comes last."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_support import AUTH, CACHE, CONTEXT, KEY, free_port, start_server
from tiny_models import make_tiny_model

DRAIN_S = 0.3   # the module server's --drain-timeout: shorter than the SIGTERM test's streams take

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", max_positions=CONTEXT)


@pytest.fixture(scope="module")
def server(model_folder, tmp_path_factory):
    running = start_server(model_folder, tmp_path_factory.mktemp("serve-log") / "server.log",
                           "--drain-timeout", str(DRAIN_S), env={"PAGEDCHAT_API_KEY": KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def engine(model_folder):
    from pagedchat import Engine

    eng = Engine(model_folder, kv_cache_memory=CACHE, dtype="float32")
    yield eng
    eng.shutdown()


CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


def test_health_answers_503_while_loading_then_200(server):
    assert server.health_codes[-1] == 200
    assert 503 in server.health_codes, "the server should listen before the model has loaded"
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT


def test_openai_client_non_streaming_and_streaming_agree(server):
    client = server.client()
    whole = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    # The second identical prompt found the first one's K/V in the prefix cache: all of it but the last token,
    # which is computed again to sample from.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_greedy_tokens_equal_the_engines_own(server, engine):
    from pagedchat import SamplingParams

    prompt = engine.encode_prompt("Paged attention keeps the KV cache in blocks.")
    [own] = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    served = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert served.choices[0].text == own.text
    assert served.usage.prompt_tokens == len(prompt) and served.usage.completion_tokens == len(own.token_ids)


def test_stop_strings_end_the_text_before_them(server):
    client = server.client()
    args = dict(model=server.model, prompt="The quick brown fox", max_tokens=40, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = full[12:15]
    cut = client.completions.create(**args, stop=[stop, "never-seen"]).choices[0]
    assert cut.finish_reason == "stop"
    assert full.startswith(cut.text) and stop not in cut.text and len(cut.text) < len(full)


def test_second_turn_hits_the_cache_for_the_first_turns_reply(server):
    client = server.client()
    # A random model's reply re-tokenizes to other ids than the sampled ones, so only the server's memory of the
    # exact ids lets turn 2 hit the reply's pages. This seed's reply holds no end token (its text would leave it
    # out) and ends on a whole character, so its text gives back every id.
    first = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=40, temperature=1.0,
                                           seed=5, extra_body={"ignore_eos": True})
    reply = first.choices[0].message.content
    turn_one = first.usage.prompt_tokens + first.usage.completion_tokens - 1   # the last token's K/V is never computed
    second = client.chat.completions.create(
        model=server.model, max_tokens=4, temperature=0,
        messages=CHAT + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}])
    full_pages = turn_one // 16 * 16
    assert full_pages > first.usage.prompt_tokens // 16 * 16   # the reply itself fills pages
    assert second.usage.prompt_tokens_details.cached_tokens >= full_pages


def test_six_concurrent_streams_all_finish(server):
    async def one(client, i: int) -> tuple[str, str, int]:
        stream = await client.chat.completions.create(
            model=server.model, max_tokens=20, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Question number {i}: what is paging?"}])
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))

    results = asyncio.run(main())
    assert [(finish, tokens) for _, finish, tokens in results] == [("length", 20)] * 6


def test_a_disconnect_cancels_the_request_and_frees_its_pages(server):
    before = server.memory()["snapshot"]
    body = {"model": server.model, "prompt": "The quick brown fox", "max_tokens": 1200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        for _ in range(3):
            next(lines)
        live = server.memory()["snapshot"]
        assert first["id"] in live["seqs"], "the engine's request id is the response id"
        assert len(live["seqs"][first["id"]]["pages"]) >= 1
    gone_at = time.monotonic() + 5
    while first["id"] in server.memory()["snapshot"]["seqs"]:
        assert time.monotonic() < gone_at, "the disconnected request still holds pages"
        time.sleep(0.05)
    after = server.memory()["snapshot"]
    assert after["free_pages"] == before["free_pages"] == after["num_pages"]
    families = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    reasons = {s.labels["finished_reason"] for s in families["pagedchat:request_success"].samples
               if s.name.endswith("_total")}
    assert "cancelled" in reasons


BAD = [
    ({"model": "m"}, "messages"),                                                         # missing messages
    ({"messages": "hello"}, "messages"),                                                  # wrong type
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),            # unknown role
    ({"messages": CHAT, "temperature": "0.5"}, "temperature"),
    ({"messages": CHAT, "top_p": 0}, "top_p"),
    ({"messages": CHAT, "max_tokens": True}, "max_tokens"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "stop": [""]}, "stop"),
    ({"messages": CHAT, "max_tokens": 1500}, "max_tokens"),                               # more than the cache holds
    ({"messages": [{"role": "user", "content": "fox " * CONTEXT}]}, "messages"),          # longer than the context
    ({"messages": CHAT, "seed": 2**64}, "seed"),                                          # beyond 64 bits
    ({"messages": CHAT, "seed": -2**63 - 1}, "seed"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_get_400_and_the_server_goes_on(server, body, param):
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert "code" in error
    ok = server.client().chat.completions.create(model=server.model, messages=CHAT, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_the_servers_sampling_ranges_are_the_declared_ones(server):
    """Each declared sampling field's bounds hold on the wire too: a bound itself is taken, a step past it is a
    400 naming the field (top_k keeps vLLM's -1 for off, below the engine's 0)."""
    from pagedchat.engine.params import SAMPLING_FIELDS

    def answer(name, value):
        return server.http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, name: value})

    for f in SAMPLING_FIELDS:
        if f.name == "top_k":
            continue
        step = 1 if f.kind is int else 0.5
        ends = []   # (a value just past the bound, the nearest value inside)
        if f.low is not None:
            ends.append((f.low, f.low + step) if f.low_open else (f.low - step, f.low))
        if f.high is not None:
            ends.append((f.high, f.high - step) if f.high_open else (f.high + step, f.high))
        for past, inside in ends:
            refused = answer(f.name, past)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == f.name, (f.name, past)
            assert answer(f.name, inside).status_code == 200, (f.name, inside)
    assert answer("top_k", -1).status_code == 200 and answer("top_k", -2).json()["error"]["param"] == "top_k"


def test_a_top_p_below_float32s_smallest_number_fails_no_one(server):
    """7e-46 rounds to 0 in float32: the sampler once found no token to keep, and every stream in that step
    failed. Now the hostile request gets its reply and the stream beside it the tokens it has alone."""
    body = {"model": server.model, "prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    alone = server.http.post("/v1/completions", json=body).json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            innocent = http.post("/v1/completions", json=body)
            hostile = [http.post("/v1/completions", json={**body, "prompt": f"{i} jumps", "temperature": 1.0,
                                                          "top_p": top_p, "max_tokens": 30})
                       for i, top_p in enumerate((7e-46, 5e-324, 1e-45, 1e-38))]
            return await asyncio.gather(innocent, *hostile)

    innocent, *hostile = asyncio.run(main())
    assert innocent.status_code == 200 and innocent.json()["choices"][0]["text"] == alone
    for response in hostile:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(server):
    """The default limit on a 2048-token model is its floor, 1 MiB: refused by Content-Length, or, for a chunked
    body that names no length, once the bytes read pass the limit."""
    big = json.dumps({"model": server.model, "prompt": "fox " * (300 * 1024)}).encode()   # 1.2 MB
    response = server.http.post("/v1/completions", content=big)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "body_too_large" and "1048576" in response.json()["error"]["message"]

    def chunks():
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]

    chunked = server.http.post("/v1/completions", content=chunks())
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"
    ok = server.client().completions.create(model=server.model, prompt="The quick", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_non_finite_numbers_and_broken_json_get_400(server):
    for raw in ('{"messages": [], "temperature": NaN', '{"prompt": "hi", "temperature": Infinity}',
                '{"prompt": "hi", "top_p": NaN}'):
        response = server.http.post("/v1/completions", content=raw)
        assert response.status_code == 400, raw
        assert response.json()["error"]["message"]


def test_content_parts_and_the_developer_role_read_as_text_and_system(server):
    client = server.client()
    plain = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    parts = client.chat.completions.create(
        model=server.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "developer", "content": CHAT[0]["content"]},
                  {"role": "user", "content": [{"type": "text", "text": "The quick brown fox "},
                                               {"type": "text", "text": "jumps over the lazy dog."}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_unknown_model_path_and_method(server):
    response = server.http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": CHAT})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert server.http.get("/v1/nothing").status_code == 404
    assert server.http.get("/v1/chat/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=CHAT)


def test_metrics_parse_with_prometheus_client(server):
    server.client().completions.create(model=server.model, prompt="The quick", max_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    value = {name: families[name].samples[0].value for name in families if families[name].samples}
    for name in ("pagedchat:num_requests_running", "pagedchat:num_requests_waiting", "pagedchat:kv_cache_usage_perc",
                 "pagedchat:prefix_cache_queries", "pagedchat:prefix_cache_hits", "pagedchat:num_preemptions",
                 "pagedchat:swap_outs", "pagedchat:kv_cache_pages", "pagedchat:kv_cache_free_pages"):
        assert name in families, name
    snap = server.memory()["snapshot"]
    assert value["pagedchat:kv_cache_pages"] == snap["num_pages"]
    assert value["pagedchat:generation_tokens"] >= 3 and value["pagedchat:prompt_tokens"] > 0
    assert value["pagedchat:prefix_cache_hits"] <= value["pagedchat:prefix_cache_queries"]
    info = families["pagedchat:cache_config_info"].samples[0].labels
    assert int(info["block_size"]) == 16 and int(info["num_gpu_blocks"]) == snap["num_pages"]


def test_the_api_key_guards_v1_but_not_health(server):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    for scheme in ("bearer", "BEARER", "Bearer "):   # RFC 7235: the scheme's name is case-insensitive
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert server.client().models.list().data[0].id == server.model
    assert httpx.get(f"{server.url}/health").status_code == 200   # open, as in vLLM
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_sigterm_ends_each_open_stream_with_a_final_chunk_and_done(server):
    """Last: it stops the module's server. Two streams that would run for long get the drain time, then each its
    final chunk (finish_reason "abort", vLLM's word for a stopped request) and [DONE]; the process exits."""
    body = {"prompt": "The quick brown fox", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as first, \
            server.http.stream("POST", "/v1/chat/completions", json={**body, "messages": CHAT}) as second:
        streams = [first.iter_lines(), second.iter_lines()]
        for lines in streams:
            next(line for line in lines if line.startswith("data: "))
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        tails = [[line for line in lines if line] for lines in streams]
        server.proc.wait(10)
        stopped = time.monotonic() - started
    for tail in tails:
        assert tail[-1] == "data: [DONE]"
        assert json.loads(tail[-2][6:])["choices"][0]["finish_reason"] == "abort"
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM.
    assert server.proc.returncode in (0, -signal.SIGTERM) and DRAIN_S <= stopped < DRAIN_S + 3
    assert "Application shutdown complete" in server.log.read_text()


def test_a_model_that_cannot_load_stops_the_server_with_one_line(tmp_path, capsys, caplog):
    from pagedchat.cli import main

    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", str(free_port())]) == 1
    assert "no such model" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "API key" in r.getMessage()]


def test_binding_beyond_loopback_without_a_key_warns(tmp_path, caplog):
    """Bound on every address for the moment the missing model takes to fail; nothing is sent to it."""
    from pagedchat.cli import main

    main(["serve", "--model", str(tmp_path / "missing"), "--host", "0.0.0.0", "--port", str(free_port())])
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "API key" in r.getMessage()]
    assert warning.startswith("listening on 0.0.0.0 with no API key")


@pytest.mark.parametrize("flag,value,message", [
    ("--max-body-size", "0", "must be at least 1 byte"), ("--max-body-size", "4xb", "cannot read '4xb' as a size"),
    ("--timeout-keep-alive", "0", "must be more than 0"), ("--drain-timeout", "-1", "must be at least 0"),
    ("--limit-concurrency", "0", "must be at least 1")])
def test_the_serve_limits_refuse_values_that_bound_nothing(flag, value, message, capsys):
    from pagedchat.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", flag, value, "--port", str(free_port())])
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("host,exposed", [("127.0.0.1", False), ("127.5.0.1", False), ("::1", False),
                                          ("localhost", False), ("0.0.0.0", True), ("::", True),
                                          ("192.168.1.4", True), ("gpu-box", True)])
def test_which_hosts_are_beyond_loopback(host, exposed):
    from pagedchat.serve.server import exposed as is_exposed

    assert is_exposed(host) is exposed


def test_the_end_of_the_context_is_length_with_vllms_stop_reason(tmp_path):
    """In-process over the real app (Starlette's TestClient runs its lifespan), on a model with a 128-token
    context (CHAT takes 73): OpenAI clients see "length", and vLLM's stop_reason says it was the context."""
    from starlette.testclient import TestClient

    from pagedchat import Engine
    from pagedchat.backends.local import LocalBackend
    from pagedchat.serve.routes import create_app

    folder = make_tiny_model(tmp_path / "short", max_positions=128)
    app = create_app(lambda: LocalBackend(Engine(folder, kv_cache_memory=CACHE, dtype="float32")), "short")
    with TestClient(app) as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.05)
        chat = http.post("/v1/chat/completions", json={"messages": CHAT, "temperature": 0,
                                                        "ignore_eos": True}).json()
        assert chat["usage"]["total_tokens"] == 128
        assert (chat["choices"][0]["finish_reason"], chat["choices"][0]["stop_reason"]) == ("length", "context_full")
        capped = http.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True}).json()["choices"][0]
        assert (capped["finish_reason"], capped["stop_reason"]) == ("length", None)
