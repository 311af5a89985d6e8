"""What shape a chat reply must take (text, JSON, tool calls) and how the model is told and held to it.

`response_format`, `tools`, `tool_choice` and `parallel_tool_calls` become one OutputPlan: the grammar the engine
constrains the reply with, and how the reply's text is read back (as content, or as OpenAI tool calls).

- json_object / json_schema: the reply is JSON (any object, or valid against the schema), as content. Objects
  that list their properties are closed to others unless the schema says otherwise (`closed`): what OpenAI's
  strict mode asks for, and what keeps a small model from inventing keys until max_tokens.
- Calls are written in the Hermes format many open models are trained on (serve/calls.py), and where a grammar
  holds the reply, each call's JSON is valid against one tool's parameters.
- tool_choice "required": the reply is calls, one or (parallel_tool_calls, OpenAI's default) several.
- tool_choice naming a function: the reply is that function's arguments, valid against its parameters.
- tool_choice "auto" (the default with tools): with a response_format, the reply is calls or an answer in that
  format, as OpenAI gives it; without one, the reply is free text, and each call in it is read. With
  parallel_tool_calls false it is free text that may end in one call, which a grammar enforces.
- tool_choice "none": the tools are neither shown nor called; a response_format shapes the reply alone.

Tools are shown to the model in a system message, in the Hermes format; assistant tool calls and tool results in
the history are written in the same format (see Message.for_template), since a template that knows no tools
(SmolLM2's) would drop them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from pagedchat.engine.structured import GrammarKind, GrammarSpec, json_rule
from pagedchat.serve.calls import CLOSE, OPEN, ToolCall, read_calls


class ReplyShape(Enum):
    TEXT = "text"
    JSON = "json"                # response_format json_object / json_schema
    TOOL_REQUIRED = "required"   # calls of any of the tools, and nothing else
    TOOL_NAMED = "named"         # the arguments of one named tool
    TOOL_AUTO = "auto"           # calls or an answer (text, or the response_format's JSON)


@dataclass(frozen=True)
class OutputPlan:
    shape: ReplyShape = ReplyShape.TEXT
    grammar: GrammarSpec | None = None
    tools: tuple[dict, ...] = ()     # the function definitions the model is shown
    named: str | None = None         # TOOL_NAMED: the function

    @property
    def calls_tools(self) -> bool:
        return self.shape in (ReplyShape.TOOL_REQUIRED, ReplyShape.TOOL_NAMED, ReplyShape.TOOL_AUTO)

    def tool_calls(self, text: str, complete: bool = True) -> list[ToolCall]:
        """The calls a reply makes (none for an answer); a reply cut short keeps the call it was writing."""
        if self.shape is ReplyShape.TOOL_NAMED:
            return [ToolCall(self.named, text)]
        if self.shape in (ReplyShape.TOOL_REQUIRED, ReplyShape.TOOL_AUTO):
            return read_calls(text, frozenset(t["name"] for t in self.tools), complete)
        return []

    def content(self, text: str, calls: list[ToolCall]) -> str | None:
        """The reply's content: none beside calls, nor where the reply can only be calls."""
        if calls or self.shape in (ReplyShape.TOOL_REQUIRED, ReplyShape.TOOL_NAMED):
            return None
        return text

    def system_prompt(self) -> str | None:
        """What the model is told about the tools (None when it is shown none)."""
        if not self.calls_tools:
            return None
        listed = "\n".join(json.dumps({"type": "function", "function": t}) for t in self.tools)
        return ("You may call functions to answer. The functions you can call are listed within <tools></tools>:\n"
                f"<tools>\n{listed}\n</tools>\nTo call one, reply with a JSON object with the function's name and "
                "arguments within <tool_call></tool_call> tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_markup(name: str, arguments: str) -> str:
    """An assistant's earlier call, as the model is shown calls to make."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _parameters(function: dict) -> dict:
    """A function's parameters schema, closed: an object that declares its properties takes no others unless
    it says so (as OpenAI's strict mode requires), since a function has no use for arguments it never named."""
    return closed(function.get("parameters") or {"type": "object", "properties": {}})


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _with_subschemas(schema: dict, fn) -> dict:
    """A copy of schema with fn applied to each of its direct subschemas (and nothing else: a "const" or a
    property's name is never mistaken for a schema)."""
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(sub) for sub in out[key]]
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key])
    return out


def closed(schema):
    """schema with every object that lists properties closed to others (where it does not say otherwise)."""
    if not isinstance(schema, dict):
        return schema
    out = _with_subschemas(schema, closed)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _rebased(schema, base: str):
    """schema with its local "$ref"s ("#", "#/...") pointing at where it now sits, at base."""
    if not isinstance(schema, dict):
        return schema
    out = _with_subschemas(schema, lambda sub: _rebased(sub, base))
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def _call_schema(functions: tuple[dict, ...]) -> dict:
    """One call `{"name", "arguments"}` of any of the functions, its arguments valid against that function's
    parameters. Each tool's schema goes whole under $defs, so that its own "$ref"s (into its $defs) still
    resolve."""
    defs = {f"tool{i}": _rebased(_parameters(f), f"#/$defs/tool{i}") for i, f in enumerate(functions)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": {"$ref": f"#/$defs/tool{i}"}}}
             for i, f in enumerate(functions)]
    return {"anyOf": calls, "$defs": defs}


# Lark string literals (a JSON string is one): what opens a call, and the lines that follow it.
_OPEN, _AFTER_OPEN, _CLOSING, _NEWLINE = (json.dumps(OPEN), json.dumps("\n"), json.dumps("\n" + CLOSE),
                                          json.dumps("\n"))
# Free text that never opens a call (TEXT), or that opens one only at its end (LEAD): a reply without parallel
# calls is TEXT, or LEAD and one call's body. Lexemes match greedily, so the call's opening belongs to LEAD.
_FREE_TEXT = (f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{OPEN}(.|\\n)*/\n"
              f"LEAD: /(.|\\n)*{OPEN}/ & ~/(.|\\n)*{OPEN}(.|\\n)+/\n")


def _calls_rules(functions: tuple[dict, ...], parallel: bool) -> str:
    """Lark rules: `call`, one Hermes block (`body` after its opening), and `calls`, one or (parallel) several on
    their own lines."""
    calls = f"calls: call ({_NEWLINE} call)*\n" if parallel else "calls: call\n"
    return (f"call: {_OPEN} body\nbody: {_AFTER_OPEN} call_json {_CLOSING}\n"
            f"call_json: {json_rule(_call_schema(functions))}\n{calls}")


def _answer_schema(response_format: dict | None) -> dict | None:
    """The JSON schema a response_format asks the answer to follow (None for text)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        return closed(response_format["json_schema"].get("schema") or {})
    return None


def plan_output(response_format: dict | None, tools: list[dict] | None, tool_choice,
                parallel_tool_calls: bool = True) -> OutputPlan:
    """The plan for a request's response_format, tools, tool_choice and parallel_tool_calls (already checked by
    protocol.py)."""
    functions = tuple(t["function"] for t in tools or [])
    answer = _answer_schema(response_format)
    if not functions or tool_choice == "none":
        if answer is None:
            return OutputPlan()
        return OutputPlan(ReplyShape.JSON, GrammarSpec.json_schema(answer))
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        [chosen] = [f for f in functions if f["name"] == name]
        return OutputPlan(ReplyShape.TOOL_NAMED, GrammarSpec.json_schema(_parameters(chosen)), functions, name)
    rules = _calls_rules(functions, parallel_tool_calls)
    if tool_choice == "required":
        return OutputPlan(ReplyShape.TOOL_REQUIRED, GrammarSpec(GrammarKind.LARK, "start: calls\n" + rules),
                          functions)
    if answer is not None:
        lark = f"start: calls | answer\nanswer: {json_rule(answer)}\n" + rules
    elif not parallel_tool_calls:
        lark = "start: TEXT | LEAD body\n" + _FREE_TEXT + rules
    else:
        return OutputPlan(ReplyShape.TOOL_AUTO, None, functions)
    return OutputPlan(ReplyShape.TOOL_AUTO, GrammarSpec(GrammarKind.LARK, lark), functions)
