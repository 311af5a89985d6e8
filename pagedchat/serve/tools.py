"""What shape a chat reply must take (text, JSON, a tool call) and how the model is told and held to it.

`response_format` and `tool_choice` become one OutputPlan: the grammar the engine constrains the reply with, and
how the reply's text is read back (as content, or as OpenAI tool calls).

- json_object / json_schema: the reply is JSON (any object, or valid against the schema), as content. Objects
  that list their properties are closed to others unless the schema says otherwise (`closed`): what OpenAI's
  strict mode asks for, and what keeps a small model from inventing keys until max_tokens.
- tool_choice "required": the reply is one call `{"name": ..., "arguments": {...}}` of one of the tools.
- tool_choice naming a function: the reply is that function's arguments, valid against its parameters.
- tool_choice "auto" (the default with tools): the reply is free; a `<tool_call>{"name", "arguments"}</tool_call>`
  in it (the Hermes format many open models are trained on) is read as a call.
- tool_choice "none": the tools are neither shown nor called.

Tools are shown to the model in a system message, in the Hermes format; assistant tool calls and tool results in
the history are written in the same format (see Message.for_template), since a template that knows no tools
(SmolLM2's) would drop them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import Enum

from pagedchat.engine.structured import GrammarSpec

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class ReplyShape(Enum):
    TEXT = "text"
    JSON = "json"                # response_format json_object / json_schema
    TOOL_REQUIRED = "required"   # one call of any tool, whole JSON
    TOOL_NAMED = "named"         # the arguments of one named tool
    TOOL_AUTO = "auto"           # free text that may hold a <tool_call>


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": index, **call} if index is not None else call


@dataclass(frozen=True)
class OutputPlan:
    shape: ReplyShape = ReplyShape.TEXT
    grammar: GrammarSpec | None = None
    tools: tuple[dict, ...] = ()     # the function definitions the model is shown
    named: str | None = None         # TOOL_NAMED: the function

    @property
    def calls_tools(self) -> bool:
        return self.shape in (ReplyShape.TOOL_REQUIRED, ReplyShape.TOOL_NAMED, ReplyShape.TOOL_AUTO)

    def tool_calls(self, text: str) -> list[ToolCall]:
        """The calls a finished reply makes (none for a plain text answer)."""
        if self.shape is ReplyShape.TOOL_NAMED:
            return [ToolCall(self.named, text)]
        if self.shape is ReplyShape.TOOL_REQUIRED:
            return [c for c in [_call_from_json(text)] if c is not None]
        if self.shape is ReplyShape.TOOL_AUTO:
            known = {t["name"] for t in self.tools}
            return [c for c in map(_call_from_json, _CALL.findall(text)) if c is not None and c.name in known]
        return []

    def system_prompt(self) -> str | None:
        """What the model is told about the tools (None when it is shown none)."""
        if not self.calls_tools:
            return None
        listed = "\n".join(json.dumps({"type": "function", "function": t}) for t in self.tools)
        return ("You may call functions to answer. The functions you can call are listed within <tools></tools>:\n"
                f"<tools>\n{listed}\n</tools>\nTo call one, reply with a JSON object with the function's name and "
                "arguments within <tool_call></tool_call> tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _call_from_json(text: str) -> ToolCall | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return ToolCall(call["name"], json.dumps(call.get("arguments", {})))


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


def plan_output(response_format: dict | None, tools: list[dict] | None, tool_choice) -> OutputPlan:
    """The plan for a request's response_format, tools and tool_choice (already checked by protocol.py)."""
    functions = tuple(t["function"] for t in tools or [])
    if functions and tool_choice != "none":
        if tool_choice == "required":
            # Each tool's schema goes whole under $defs, so that its own "$ref"s (into its $defs) still resolve.
            defs = {f"tool{i}": _rebased(_parameters(f), f"#/$defs/tool{i}") for i, f in enumerate(functions)}
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": f["name"]}, "arguments": {"$ref": f"#/$defs/tool{i}"}}}
                     for i, f in enumerate(functions)]
            schema = {"anyOf": calls, "$defs": defs}
            return OutputPlan(ReplyShape.TOOL_REQUIRED, GrammarSpec.json_schema(schema), functions)
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            [chosen] = [f for f in functions if f["name"] == name]
            return OutputPlan(ReplyShape.TOOL_NAMED, GrammarSpec.json_schema(_parameters(chosen)), functions, name)
        return OutputPlan(ReplyShape.TOOL_AUTO, None, functions)
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return OutputPlan(ReplyShape.JSON, GrammarSpec.json_schema({"type": "object"}))
    if kind == "json_schema":
        schema = closed(response_format["json_schema"].get("schema") or {})
        return OutputPlan(ReplyShape.JSON, GrammarSpec.json_schema(schema))
    return OutputPlan()
