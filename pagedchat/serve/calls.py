"""Tool calls read back from a reply's text, in the Hermes format the tools are shown in:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

A reply cut short (max_tokens, the context's end, a cancel) keeps the call it was writing, with the arguments so
far, as OpenAI and vLLM return it: a client sees the same shape whether the reply was streamed or not.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")
# The start of a call cut short: its name (maybe cut too), then maybe the start of its arguments.
_CUT = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)(")?(\s*,\s*"arguments"\s*:\s*)?', re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it (cut JSON for a call cut short)

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": index, **call} if index is not None else call


def read_calls(text: str, known: frozenset[str], complete: bool) -> list[ToolCall]:
    """The calls of known tools in text; where the reply is not complete, its last block, left open, is a call
    too (when its name is known by then)."""
    starts = [m.end() for m in re.finditer(re.escape(OPEN), text)]
    calls = []
    for k, start in enumerate(starts):
        call = _whole_call(text, start)
        if call is None and not complete and k == len(starts) - 1:
            call = _cut_call(text[start:], known)
        if call is not None and call.name in known:
            calls.append(call)
    return calls


def call_from_json(value) -> ToolCall | None:
    """A call from its decoded `{"name", "arguments"}` object (None if it is not one)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ToolCall(value["name"], json.dumps(value.get("arguments", {})))


def _whole_call(text: str, start: int) -> ToolCall | None:
    """The call whose JSON begins after start and is closed by </tool_call> (None if it is not)."""
    at = _SPACE.match(text, start).end()
    try:
        value, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    if not text.startswith(CLOSE, _SPACE.match(text, end).end()):
        return None
    return call_from_json(value)


def _cut_call(fragment: str, known: frozenset[str]) -> ToolCall | None:
    """A call cut short: its name (a cut name stands for the one known tool it begins, if only one does) and
    the arguments written so far ("" before they begin)."""
    match = _CUT.match(fragment)
    if match is None:
        return None
    name, closed, before_arguments = match.groups()
    if closed is None:
        begun = [k for k in known if k.startswith(name)]
        return ToolCall(begun[0], "") if len(begun) == 1 else None
    if before_arguments is None:
        return ToolCall(name, "")
    arguments = fragment[match.end():]
    try:   # arguments whole, cut in the wrapper's own closing
        _, end = _DECODER.raw_decode(arguments)
        arguments = arguments[:end]
    except ValueError:
        pass
    return ToolCall(name, arguments)
