"""How a chat reply's shape is planned (serve/tools.py) and how tool history goes into the prompt."""

from __future__ import annotations

import json

from pagedchat.serve.protocol import ChatRequest, parse
from pagedchat.serve.tools import ReplyShape, ToolCall, closed, plan_output

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_auto_reads_hermes_tool_calls_of_known_tools_only():
    plan = plan_output(None, [{"type": "function", "function": TOOL}], None)
    assert plan.shape is ReplyShape.TOOL_AUTO and plan.grammar is None
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')
    assert plan.tool_calls(text) == [ToolCall("get_weather", '{"city": "Oslo"}')]
    assert plan.tool_calls("It rains in Oslo.") == []
    assert "get_weather" in plan.system_prompt()


def test_none_shows_no_tools_and_text_formats_plan_no_grammar():
    assert plan_output(None, [{"type": "function", "function": TOOL}], "none").system_prompt() is None
    assert plan_output({"type": "text"}, None, None).grammar is None


def _call_schema(plan) -> dict:
    """The JSON schema a plan's Lark grammar holds each call to."""
    [line] = [line for line in plan.grammar.source.splitlines() if line.startswith("call_json: %json ")]
    return json.loads(line.removeprefix("call_json: %json "))


def test_required_and_named_constrain_to_closed_schemas():
    tools = [{"type": "function", "function": TOOL}]
    required = plan_output(None, tools, "required")
    schema = _call_schema(required)
    call = schema["anyOf"][0]
    assert call["properties"]["name"] == {"const": "get_weather"}
    assert call["properties"]["arguments"] == {"$ref": "#/$defs/tool0"}
    assert schema["$defs"]["tool0"]["additionalProperties"] is False
    assert required.tool_calls('<tool_call>\n{"name":"get_weather","arguments":{"city":"Lima"}}\n</tool_call>') == \
        [ToolCall("get_weather", '{"city": "Lima"}')]
    named = plan_output(None, tools, {"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_calls('{"city":"Lima"}') == [ToolCall("get_weather", '{"city":"Lima"}')]


def test_a_call_cut_short_keeps_its_name_and_arguments_so_far():
    tools = [{"type": "function", "function": TOOL}, {"type": "function", "function": {**TOOL, "name": "get_time"}}]
    plan = plan_output(None, tools, "required")
    cut = '<tool_call>\n{"name":"get_weather","arguments":{"ci'
    assert plan.tool_calls(cut, complete=False) == [ToolCall("get_weather", '{"ci')]
    assert plan.tool_calls(cut) == []
    assert plan.tool_calls('<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool', complete=False) == \
        [ToolCall("get_weather", "{}")]
    assert plan.tool_calls('<tool_call>\n{"name":"get_w', complete=False) == [ToolCall("get_weather", "")]
    assert plan.tool_calls('<tool_call>\n{"name":"get_', complete=False) == []   # either tool
    assert plan.content(cut, []) is None   # a reply that can only be calls has no content


def test_closed_keeps_what_a_schema_says_and_a_property_named_properties():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "additionalProperties": True,
                                                              "properties": {"a": {"type": "integer"}}},
                                               "items": {"type": "array", "items": {"properties": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"properties", "items"}
    assert out["properties"]["properties"]["additionalProperties"] is True
    assert out["properties"]["items"]["items"]["additionalProperties"] is False


def test_tool_history_is_written_as_hermes_turns_every_template_renders():
    body = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12C"}],
        "tools": [{"type": "function", "function": TOOL}]}
    messages = parse(ChatRequest, json.dumps(body).encode()).template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == messages[2]["content"]
    assert messages[3]["content"] == "<tool_response>\n12C\n</tool_response>"


def test_required_keeps_each_tools_own_refs_resolvable():
    """Nested pydantic models put $defs in a tool's schema; under "required" each tool's schema moves, and its
    refs move with it, so llguidance compiles the whole."""
    from pagedchat.engine.structured import GrammarCompiler
    from tiny_models import VOCAB_SIZE, make_tokenizer

    nested = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}, "boss": {"$ref": "#"}},
              "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string", "const": "#/x"}}}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": nested}} for n in ("a", "b")]
    plan = plan_output(None, tools, "required")
    schema = _call_schema(plan)
    second = schema["$defs"]["tool1"]["properties"]
    assert second["home"] == {"$ref": "#/$defs/tool1/$defs/Addr"} and second["boss"] == {"$ref": "#/$defs/tool1"}
    assert schema["$defs"]["tool1"]["$defs"]["Addr"]["properties"]["city"]["const"] == "#/x"
    tok = make_tokenizer()
    GrammarCompiler(tok, VOCAB_SIZE, tok.eos_token_id).compile(plan.grammar)


def _accepts(plan, text: str) -> bool:
    """Whether the plan's grammar, compiled over the tiny tokenizer, takes text whole."""
    from pagedchat.engine.structured import GrammarCompiler
    from tiny_models import VOCAB_SIZE, make_tokenizer

    tok = make_tokenizer()
    matcher = GrammarCompiler(tok, VOCAB_SIZE, tok.eos_token_id).compile(plan.grammar).matcher()
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'


def test_auto_without_parallel_calls_is_free_text_that_may_end_in_one_call():
    plan = plan_output(None, [{"type": "function", "function": TOOL}], "auto", parallel_tool_calls=False)
    assert plan.shape is ReplyShape.TOOL_AUTO
    assert _accepts(plan, "It rains <tool_ in Oslo.") and _accepts(plan, f"Let me look. {CALL}")
    assert not _accepts(plan, f"{CALL}\n{CALL}") and not _accepts(plan, f"{CALL} done")
    assert not _accepts(plan, '<tool_call>\n{"name":"rm_rf","arguments":{}}\n</tool_call>')
    assert plan.tool_calls(f"Let me look. {CALL}") == [ToolCall("get_weather", '{"city": "Oslo"}')]


def test_auto_with_a_response_format_is_calls_or_the_answer():
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                             "required": ["a"]}}}
    tools = [{"type": "function", "function": TOOL}]
    one, several = (plan_output(fmt, tools, "auto", parallel_tool_calls=p) for p in (False, True))
    for plan in (one, several):
        assert _accepts(plan, CALL) and _accepts(plan, '{"a":1}') and not _accepts(plan, "Hello")
        assert plan.content('{"a":1}', plan.tool_calls('{"a":1}')) == '{"a":1}'
    assert not _accepts(one, f"{CALL}\n{CALL}") and _accepts(several, f"{CALL}\n{CALL}")
