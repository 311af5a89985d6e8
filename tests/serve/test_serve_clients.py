"""The clients people point at `pagedchat serve`, against a real server subprocess on 127.0.0.1 on a tiny model:
openai (parse, tools, n, logprobs), langchain-openai (with_structured_output, bind_tools), litellm (its error
classes), the OpenAI Agents SDK and pydantic-ai (an output type beside tools) and instructor (JSON, JSON_SCHEMA
and TOOLS modes). Every JSON the model writes validates against its
schema: the grammar allows nothing else, even from a random model."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from serve_support import CONTEXT, KEY, start_server
from tiny_models import make_tiny_model


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fox"]
    legs: int = Field(ge=0, le=8)
    name: str = Field(max_length=8)


class Weather(BaseModel):
    """Get the weather in a city."""

    city: Literal["Paris", "Oslo", "Lima"]
    celsius: bool


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                                  "parameters": Weather.model_json_schema()}}
PET_TOOL = {"type": "function", "function": {"name": "add_pet", "parameters": Pet.model_json_schema()}}
ASK = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("clients") / "tiny", max_positions=CONTEXT)
    running = start_server(folder, tmp_path_factory.mktemp("clients-log") / "server.log",
                           env={"PAGEDCHAT_API_KEY": KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


# ---- structured output -------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_parse_gives_a_valid_pydantic_object(server, client, temperature):
    done = client.chat.completions.parse(model=server.model, messages=ASK, response_format=Pet, max_tokens=80,
                                         temperature=temperature, seed=4)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_mode_writes_one_json_object(server, client):
    done = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=200, seed=1,
                                          response_format={"type": "json_object"}, n=4)
    finished = [c for c in done.choices if c.finish_reason == "stop"]
    assert finished, "no reply closed its object within 200 tokens"
    for c in finished:
        assert isinstance(json.loads(c.message.content), dict)


def test_a_bad_schema_is_a_400_naming_response_format(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert err.value.body["param"] == "response_format" and "json_schema" in err.value.body["message"]


# ---- tools -------------------------------------------------------------------------------------------------
def test_a_named_tool_choice_returns_a_valid_call(server, client):
    done = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER_TOOL, PET_TOOL],
                                          tool_choice={"type": "function", "function": {"name": "add_pet"}},
                                          max_tokens=80, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add_pet"
    Pet.model_validate_json(call.function.arguments)


def test_tool_choice_required_calls_one_of_the_tools(server, client):
    done = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER_TOOL, PET_TOOL],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                          temperature=1.0, seed=2, n=3)
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        model = {"get_weather": Weather, "add_pet": Pet}[call.function.name]
        model.model_validate_json(call.function.arguments)


def test_a_named_tool_call_streams_its_arguments_as_deltas(server, client):
    args = dict(model=server.model, messages=ASK, tools=[WEATHER_TOOL], max_tokens=80, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0].function.arguments
    deltas = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert len(calls) > 2 and {c.index for c in calls} == {0}
    assert calls[0].function.name == "get_weather" and calls[0].id and not any(c.id for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == whole
    Weather.model_validate_json(whole)
    assert deltas[-1].finish_reason == "tool_calls"


def test_required_tool_calls_stream_as_one_delta_per_reply(server, client):
    stream = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER_TOOL, PET_TOOL],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                            temperature=1.0, seed=2, n=2, stream=True)
    calls: dict[int, list] = {0: [], 1: []}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            calls[c.index] += c.delta.tool_calls or []
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for [call] in calls.values():
        {"get_weather": Weather, "add_pet": Pet}[call.function.name].model_validate_json(call.function.arguments)


def test_tool_results_and_earlier_calls_go_into_the_prompt(server, client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "celsius": true}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees and rain"}]
    without = client.chat.completions.create(model=server.model, messages=history[:1], max_tokens=1)
    shown = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER_TOOL],
                                           tool_choice="none", max_tokens=1)
    offered = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER_TOOL],
                                             max_tokens=1)
    assert without.usage.prompt_tokens < shown.usage.prompt_tokens < offered.usage.prompt_tokens
    assert offered.choices[0].message.tool_calls is None   # one random token calls nothing


# ---- n, logprobs, the sampling controls -------------------------------------------------------------------
def test_n_replies_count_the_prompt_once_and_greedy_ones_agree(server, client):
    one = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    three = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=12, temperature=0, n=3,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 36


def test_n_sampled_replies_differ_and_stream_with_their_index(server, client):
    args = dict(model=server.model, messages=ASK, max_tokens=10, temperature=1.0, seed=9, n=3,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts   # each reply's seed is the request's plus its index


def test_chat_logprobs_are_those_of_the_greedy_tokens(server, client):
    done = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = done.choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.token == e.top_logprobs[0].token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob


def test_logprobs_are_taken_after_the_grammar_mask(server, client):
    """The schema forces the opening `{"kind":"`: a token the grammar forces has probability 1."""
    done = client.chat.completions.parse(model=server.model, messages=ASK, response_format=Pet, max_tokens=80,
                                         temperature=0, logprobs=True)
    assert done.choices[0].logprobs.content[0].logprob == 0.0


def test_completion_logprobs_in_the_legacy_shape(server, client):
    done = client.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=5,
                                     temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == done.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))


def _greedy(client, server, temperature: float = 0.0, **extra):
    """16 tokens after one prompt (seeded when sampled); OpenAI's own fields as arguments, vLLM's in the body."""
    own = {k: extra.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias") if k in extra}
    return client.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=16, seed=5,
                                     temperature=temperature, logprobs=0, extra_body={"ignore_eos": True, **extra},
                                     **own)


def _token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def test_logit_bias_and_penalties_change_what_comes_back(server, client):
    plain = _greedy(client, server, return_tokens_as_token_ids=True)
    first = plain.choices[0].logprobs.tokens[0]
    biased = _greedy(client, server, logit_bias={str(_token_id(first)): -100}, return_tokens_as_token_ids=True)
    assert biased.choices[0].logprobs.tokens[0] != first
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert _greedy(client, server, **extra).choices[0].text != plain.choices[0].text, extra


def test_stop_token_ids_and_min_tokens(server, client):
    tokens = _greedy(client, server, 1.0, return_tokens_as_token_ids=True).choices[0].logprobs.tokens
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])   # a token's first appearance
    stop = _token_id(tokens[k])
    stopped = _greedy(client, server, 1.0, stop_token_ids=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == k + 1
    held = _greedy(client, server, 1.0, stop_token_ids=[stop], min_tokens=k + 3, return_tokens_as_token_ids=True)
    assert held.usage.completion_tokens >= k + 3 and held.choices[0].logprobs.tokens[k] != tokens[k]


# ---- the API's edges -------------------------------------------------------------------------------------------
def test_null_is_accepted_for_every_optional_field(server):
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                               "logprobs", "top_logprobs", "max_tokens", "stop", "seed", "logit_bias", "tools",
                               "tool_choice", "response_format", "stream_options", "user", "best_of")}
    response = server.http.post("/v1/chat/completions", json={"messages": ASK, **nulls, "max_tokens": 3})
    assert response.status_code == 200, response.text
    response = server.http.post("/v1/completions", json={"prompt": "hi", **nulls, "echo": None, "suffix": None})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("function_call", "auto"),
                                         ("best_of", 3), ("audio", {"voice": "x"}), ("prediction", {"x": 1})])
def test_unsupported_fields_are_a_400_naming_them(server, field, value):
    response = server.http.post("/v1/chat/completions", json={"messages": ASK, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_get_one_model(server, client):
    assert client.models.retrieve(server.model).max_model_len == CONTEXT
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_max_tokens_past_the_context_is_context_length_exceeded(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=CONTEXT)
    assert err.value.code == "context_length_exceeded" and err.value.param == "max_tokens"


def test_litellm_maps_context_overflow_and_a_bad_key(server):
    litellm = pytest.importorskip("litellm")
    args = dict(model=f"openai/{server.model}", api_base=f"{server.url}/v1", messages=ASK, num_retries=0)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**args, api_key=KEY, max_tokens=CONTEXT)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**{**args, "messages": [{"role": "user", "content": "fox " * CONTEXT}]}, api_key=KEY)
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(**args, api_key="wrong", max_tokens=2)


# ---- langchain and instructor ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=server.model, base_url=f"{server.url}/v1", api_key=KEY,
                                       max_retries=0, temperature=0, max_tokens=80)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    pet = chat_model.with_structured_output(Pet, method=method).invoke("Name a pet.")
    assert isinstance(pet, Pet)


def test_langchain_bind_tools_with_a_chosen_tool(chat_model):
    reply = chat_model.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Oslo?")
    [call] = reply.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


def test_langchain_maps_context_overflow(chat_model):
    from langchain_openai.chat_models.base import OpenAIContextOverflowError

    with pytest.raises(OpenAIContextOverflowError):
        chat_model.invoke("fox " * CONTEXT)


# ---- agent frameworks: an answer in a schema beside tools, one request carrying both -----------------------------
def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
    """Get the weather in a city."""
    return f"Sunny in {city}"


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_openai_agents_output_type_beside_tools(server, tool_choice):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    agent = agents.Agent(name="pets", instructions="Name a pet.", output_type=Pet,
                         tools=[agents.function_tool(get_weather)],
                         model=agents.OpenAIChatCompletionsModel(model=server.model, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice=tool_choice, max_tokens=80, temperature=0))
    result = agents.Runner.run_sync(agent, "Name a pet.", max_turns=4)
    assert isinstance(result.final_output, Pet)


def test_pydantic_ai_native_output_beside_tools(server):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key=KEY))
    agent = pydantic_ai.Agent(model, output_type=pydantic_ai.NativeOutput(Pet), tools=[get_weather],
                              model_settings={"max_tokens": 80, "temperature": 0})
    assert isinstance(agent.run_sync("Name a pet.").output, Pet)


class Note(BaseModel):
    """Any JSON object is a Note: instructor's JSON mode shows the schema only in the prompt, which a random
    model cannot read."""

    model_config = ConfigDict(extra="ignore")
    title: str | int | float | bool | None | list | dict = None


@pytest.mark.parametrize("mode,model", [("JSON", Note), ("JSON_SCHEMA", Pet), ("TOOLS", Pet)])
def test_instructor_modes(client, server, mode, model):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    got = patched.chat.completions.create(model=server.model, response_model=model, messages=ASK, max_tokens=80,
                                          temperature=0, max_retries=0)
    assert isinstance(got, model)


@pytest.mark.parametrize("field,value", [("logit_bias", {"999999": 5}), ("logit_bias", {"-3": 5}),
                                         ("logit_bias", {"7": 101}), ("stop_token_ids", [999999]),
                                         ("top_logprobs", 21), ("presence_penalty", 2.5), ("n", 17)])
def test_bad_sampling_controls_are_a_400_naming_them(server, field, value):
    body = {"messages": ASK, field: value, "max_tokens": 2, **({"logprobs": True} if field == "top_logprobs" else {})}
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


# ---- the default model -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_default_model_writes_valid_json_for_every_client(default_model, tmp_path):
    running = start_server(default_model, tmp_path / "server.log", "--kv-cache-memory", "64MiB",
                           env={"PAGEDCHAT_API_KEY": KEY})
    try:
        client = running.client()
        model = client.models.list().data[0].id
        ask = [{"role": "user", "content": "Describe a small pet as JSON."}]
        pet = client.chat.completions.parse(model=model, messages=ask, response_format=Pet, max_tokens=60,
                                            temperature=0).choices[0].message.parsed
        assert isinstance(pet, Pet)
        done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                              tools=[WEATHER_TOOL], tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=100, temperature=0)
        [call] = done.choices[0].message.tool_calls
        Weather.model_validate_json(call.function.arguments)
        # A question whose answer the model closes: asked to describe a pet freely, it may count up a list until
        # max_tokens on one kernel level and close on another (near-ties), which says nothing about the server.
        keys = [{"role": "user", "content": "Give a JSON object with the keys name and color for a small pet."}]
        obj = client.chat.completions.create(model=model, messages=keys, response_format={"type": "json_object"},
                                             max_tokens=120, temperature=0).choices[0]
        assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)
    finally:
        running.stop()


def test_streamed_logprobs_come_with_their_tokens(server, client):
    args = dict(model=server.model, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=1,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**args, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    # The second run finds the prompt in the prefix cache: the same tokens, logits equal to float32 rounding.
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
