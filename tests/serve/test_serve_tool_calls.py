"""Tool calls and response formats as the agent frameworks send them, against a real `pagedchat serve` on a tiny
random model, through the openai client: a response_format beside tools, parallel_tool_calls, a call cut by
max_tokens, and schemas over llguidance's limits or with no value at all."""

from __future__ import annotations

import json
import threading
import time
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from serve_support import CONTEXT, KEY, HealthWatch, start_server
from tiny_models import make_tiny_model, make_tokenizer


class Weather(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: bool


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fox"]
    legs: int = Field(ge=0, le=8)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": Pet.model_json_schema()}}
ASK = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
_TOK = make_tokenizer()
NEWLINE, LESS_THAN = _TOK.convert_tokens_to_ids(["Ċ", "<"])   # byte-level "\n" and "<"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tool-calls") / "tiny", max_positions=CONTEXT)
    running = start_server(folder, tmp_path_factory.mktemp("tool-calls-log") / "server.log",
                           env={"PAGEDCHAT_API_KEY": KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def _create(server, client, **args):
    return client.chat.completions.create(model=server.model, messages=ASK, **args)


# ---- a response_format beside tools ---------------------------------------------------------------------------
def test_auto_with_a_response_format_answers_in_the_schema_or_calls(server, client):
    """The OpenAI Agents SDK's output_type with tools, pydantic-ai's NativeOutput with tools: every reply is
    either calls of the tools or an answer valid against the schema; both come up over a few seeds."""
    done = _create(server, client, tools=[WEATHER_TOOL], response_format=PET_FORMAT, max_tokens=300,
                   temperature=1.0, seed=3, n=8)
    shapes = set()
    for choice in done.choices:
        assert choice.finish_reason in ("stop", "tool_calls"), choice
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for call in choice.message.tool_calls:
                assert call.function.name == "get_weather"
                Weather.model_validate_json(call.function.arguments)
            shapes.add("call")
        else:
            Pet.model_validate_json(choice.message.content)
            shapes.add("answer")
    assert shapes == {"call", "answer"}


def test_a_forced_call_or_no_tools_beside_a_response_format(server, client):
    required = _create(server, client, tools=[WEATHER_TOOL], response_format=PET_FORMAT, tool_choice="required",
                       parallel_tool_calls=False, max_tokens=300, temperature=0)
    [call] = required.choices[0].message.tool_calls
    Weather.model_validate_json(call.function.arguments)
    none = _create(server, client, tools=[WEATHER_TOOL], tool_choice="none", response_format=PET_FORMAT,
                   max_tokens=120, temperature=0).choices[0]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    Pet.model_validate_json(none.message.content)


# ---- parallel_tool_calls ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice,extra", [("required", {}), ("auto", {"response_format": PET_FORMAT})])
def test_parallel_tool_calls_false_allows_one_call_and_true_several(server, client, choice, extra):
    """A bias on "\\n" asks for another call after each: the grammar refuses it without parallel calls."""
    bias = {str(NEWLINE): 100, str(LESS_THAN): 100}
    args = dict(tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=400, temperature=0, logit_bias=bias, **extra)
    one = _create(server, client, parallel_tool_calls=False, **args).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    Weather.model_validate_json(one.message.tool_calls[0].function.arguments)
    several = _create(server, client, parallel_tool_calls=True, **args).choices[0]
    assert len(several.message.tool_calls) > 1
    for call in several.message.tool_calls[:-1]:   # the last may be cut by max_tokens
        Weather.model_validate_json(call.function.arguments)


# ---- a call cut by max_tokens ---------------------------------------------------------------------------------
def _streamed(server, client, **args):
    """A streamed reply's tool calls ({index: [name, arguments]}), content and finish reason."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in _create(server, client, stream=True, **args):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                name, arguments = calls.setdefault(tc.index, ["", ""])
                calls[tc.index] = [name + (tc.function.name or ""), arguments + (tc.function.arguments or "")]
    return calls, content or None, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_by_max_tokens_has_the_same_shape_streamed_or_not(server, client, choice):
    """OpenAI's and vLLM's shape: a tool_calls entry with the arguments so far, and finish_reason "length"."""
    args = dict(tools=[WEATHER_TOOL], tool_choice=choice, temperature=0, parallel_tool_calls=False)
    whole = _create(server, client, max_tokens=300, **args)
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    compact = json.dumps(json.loads(arguments), separators=(",", ":"))
    cut_at = whole.usage.completion_tokens - 20   # inside the arguments, for either shape
    cut = _create(server, client, max_tokens=cut_at, **args).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    [call] = cut.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = call.function.arguments
    assert arguments and compact.startswith(arguments) and arguments != compact
    calls, content, finish = _streamed(server, client, max_tokens=cut_at, **args)
    assert (calls, content, finish) == ({0: ["get_weather", call.function.arguments]}, None, "length")


# ---- schemas llguidance cannot hold a reply to ------------------------------------------------------------------
def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}},
    {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(3000)]},
], ids=["5000-optional-properties", "anyOf-3000"])
def test_a_schema_over_llguidances_limits_is_a_400_naming_the_limit(server, client, schema):
    with pytest.raises(openai.BadRequestError) as err:
        _create(server, client, response_format=_schema_format(schema), max_tokens=50)
    assert err.value.param == "response_format" and "max_items_in_row" in err.value.body["message"]


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"anyOf": [{"$ref": "#/anyOf/1"}, {"$ref": "#/anyOf/0"}]},
                                    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}])
def test_a_schema_with_no_finite_value_is_a_400(server, client, schema):
    """Before, {"$ref": "#"} answered 200 with content "" and finish_reason "stop", which promises valid JSON."""
    with pytest.raises(openai.BadRequestError) as err:
        _create(server, client, response_format=_schema_format(schema), max_tokens=50)
    assert err.value.param == "response_format"
    cyclic = {"type": "function", "function": {"name": "loop", "parameters": schema}}
    with pytest.raises(openai.BadRequestError) as err:
        _create(server, client, tools=[cyclic], tool_choice={"type": "function", "function": {"name": "loop"}},
                max_tokens=50)
    assert err.value.param == "tools"


# ---- a slow schema and everyone else --------------------------------------------------------------------------
@pytest.mark.timing
def test_a_schema_slow_to_compile_is_a_400_and_holds_up_no_one(tmp_path):
    """Compiling many optional properties costs their square; while one compiles past its deadline, a plain
    request is as quick as before and /health answers at once."""
    folder = make_tiny_model(tmp_path / "tiny", max_positions=CONTEXT)
    server = start_server(folder, tmp_path / "server.log", "--grammar-timeout", "1", env={"PAGEDCHAT_API_KEY": KEY})
    client, hostile = server.client(), server.client()

    def innocent() -> float:
        started = time.perf_counter()
        _create(server, client, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        return time.perf_counter() - started

    refused: list[openai.BadRequestError] = []

    def send() -> None:
        slow = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(8000)}}
        try:
            _create(server, hostile, response_format=_schema_format(slow), max_tokens=10)
        except openai.BadRequestError as exc:
            refused.append(exc)

    try:
        quiet = min(innocent() for _ in range(2))
        with HealthWatch(server.url) as health:
            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(0.5)   # the compile is under way
            loaded = [innocent() for _ in range(3)]
            sender.join(60)
    finally:
        server.stop()
    assert refused and "did not compile within 1 s" in refused[0].body["message"]
    assert refused[0].param == "response_format"
    assert max(loaded) < 3 * quiet + 1.0, (quiet, loaded)
    assert max(health.latencies) < 1.0
