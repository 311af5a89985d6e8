"""The OpenAI request bodies `pagedchat serve` accepts, and the error it answers a bad one with.

Validation is strict about the fields it knows (types, ranges, finite numbers) and ignores the ones it does not,
as vLLM does: OpenAI clients and editors send vendor fields freely, and refusing them would break those clients.
Known OpenAI fields whose effect the engine cannot give (UNSUPPORTED) are refused unless left out or null, so a
client never silently gets something other than what it asked for. null stands for "the default" in every
optional field, as in OpenAI's API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pagedchat.engine.params import FIELDS, MAX_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from pagedchat.serve.tools import OutputPlan, call_markup, plan_output

# Known OpenAI (and vLLM) fields that would change the reply in a way this server cannot give.
UNSUPPORTED = {
    "functions": "the legacy functions field is not supported: send tools",
    "function_call": "the legacy function_call field is not supported: send tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}
# Replies to one prompt a request may ask for (n): each runs as its own sequence.
MAX_N = 16


# An error's message is cut to this many bytes of UTF-8: a message may quote what the client sent (a grammar, a
# model name, a path), and the answer must not grow with the request.
MAX_ERROR_BYTES = 400


def capped(message: str, limit: int = MAX_ERROR_BYTES) -> str:
    """message, or its first bytes (whole characters) and how long it was, within limit bytes."""
    data = message.encode("utf-8", "replace")
    if len(data) <= limit:
        return message
    tail = f"... ({len(data)} bytes in all)"
    return data[:limit - len(tail)].decode("utf-8", "ignore") + tail


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}` with an HTTP status. Every
    error the server answers is one, so its message is capped here."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        message = capped(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # strict: "1" is not a number and true is not 1; allow_inf_nan=False: NaN and Infinity are refused.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null means the field's default, as in OpenAI's API."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class AssistantToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                     # a tool message: the call it answers

    def for_template(self) -> dict:
        """The {"role", "content"} the chat template takes; OpenAI's newer "developer" role is the system one.
        Tool calls and results are written in the Hermes format the tools are shown in (serve/tools.py), and a
        tool result comes as a user turn, which every template renders."""
        role = "system" if self.role == "developer" else self.role
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        if self.tool_calls:
            calls = [call_markup(c.function.name, c.function.arguments) for c in self.tool_calls]
            content = "\n".join([content, *calls] if content else calls)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        return {"role": role, "content": content}


class Function(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


def _within(name: str) -> dict:
    """The declared bounds of a sampling field (engine/params.py), as pydantic's Field takes them."""
    return FIELDS[name].bounds()


class _Request(_Body):
    # The ranges are the engine's declared ones; the defaults are OpenAI's where they differ.
    model: str | None = None
    max_tokens: int | None = Field(None, **_within("max_tokens"))
    temperature: float = Field(1.0, **_within("temperature"))   # OpenAI's default: sampling, not greedy
    top_p: float = Field(FIELDS["top_p"].default, **_within("top_p"))
    top_k: int = Field(FIELDS["top_k"].default, ge=-1)   # vLLM's extra field; -1 (vLLM's off) and 0 both turn it off
    seed: int | None = Field(None, **_within("seed"))    # what torch's generator takes
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                    # vLLM's extra field; the bench forces replies to a fixed length
    presence_penalty: float = Field(FIELDS["presence_penalty"].default, **_within("presence_penalty"))
    frequency_penalty: float = Field(FIELDS["frequency_penalty"].default, **_within("frequency_penalty"))
    repetition_penalty: float = Field(FIELDS["repetition_penalty"].default,   # vLLM's extra field
                                      **_within("repetition_penalty"))
    logit_bias: dict[str, float] | None = None          # token id (as text) -> bias in [-MAX_BIAS, MAX_BIAS]
    min_tokens: int = Field(FIELDS["min_tokens"].default, **_within("min_tokens"))   # vLLM's extra field
    stop_token_ids: list[int] | None = None             # vLLM's extra field
    best_of: int | None = None
    return_tokens_as_token_ids: bool = False            # vLLM's extra field: logprobs name tokens "token_id:N"

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """Known fields this server cannot honour are refused by name (after nulls are dropped)."""
        if isinstance(data, dict):
            for name, why in UNSUPPORTED.items():
                if data.get(name) is not None and name not in cls.model_fields:
                    raise ApiError(400, why, param=name)
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        """Refuse what the engine cannot do, naming the field."""
        if not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n must be between 1 and {MAX_N}", param="n")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of is not supported (only best_of equal to n)", param="best_of")
        self.bias_pairs()
        if any(not s for s in self.stop_strings):
            raise ApiError(400, "a stop string must not be empty", param="stop")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            # A token id is ASCII digits only: str.isdigit also takes "²" (which int() refuses) and "١٢" (12).
            if not (key.isascii() and key.isdigit()) or not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ApiError(400, f"logit_bias maps token ids (ASCII digits) to numbers in [-{MAX_BIAS}, "
                               f"{MAX_BIAS}] (got {key!r}: {bias!r})", param="logit_bias")
            pairs.append((int(key), bias))
        return tuple(pairs)

    def check_token_ids(self, vocab_size: int | None) -> None:
        """Token ids named in logit_bias and stop_token_ids must be the model's."""
        if vocab_size is None:
            return
        for name, ids in (("logit_bias", [t for t, _ in self.bias_pairs()]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param=name)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; k: the chosen tokens' and the k likeliest alternatives'."""
        return None

    def sampling_params(self, max_tokens: int, grammar=None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop=self.stop_strings,
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias=self.bias_pairs(), min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=self.top_logprobs_wanted,
                              grammar=grammar)

    def output_plan(self) -> OutputPlan:
        return OutputPlan()


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **_within("max_tokens"))   # OpenAI's newer name for it
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True   # false: a reply makes at most one call (OpenAI's default is true)
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's extra fields: continue the last (assistant) message rather than answer after it. The app's fork of
    # a live reply over HTTP sends the reply so far this way.
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs true", param="top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise ApiError(400, f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (
                fmt.json_schema is None or fmt.json_schema.schema_ is None):
            raise ApiError(400, "a json_schema response_format needs json_schema.schema", param="response_format")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ApiError(400, "continue_final_message needs add_generation_prompt false and an assistant "
                           "message last", param="continue_final_message")
        if not self.continue_final_message and not self.add_generation_prompt:
            raise ApiError(400, "add_generation_prompt false is supported only with continue_final_message",
                           param="add_generation_prompt")

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_plan(self) -> OutputPlan:
        fmt = self.response_format.model_dump(by_alias=True, exclude_none=True) if self.response_format else None
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return plan_output(fmt, tools, choice, self.parallel_tool_calls)

    def template_messages(self) -> list[dict]:
        """The messages for the template; the tools the model may call go in a system message of their own,
        after the request's first system message if it has one."""
        messages = [m.for_template() for m in self.messages]
        shown = self.output_plan().system_prompt()
        if shown is not None:
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{shown}"}
            else:
                messages.insert(0, {"role": "system", "content": shown})
        return messages


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    max_tokens: int | None = Field(16, **_within("max_tokens"))   # the legacy endpoint's default is 16 tokens
    # A text prompt is plain text, as a chat's messages are: special tokens' text in it is read as text. A raw
    # prompt whose author writes the template's markers himself asks for them with this.
    parse_special_tokens: bool = False

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            raise ApiError(400, "one prompt per request is supported", param="prompt")
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported", param=name)

    def prompt_input(self) -> str | list[int]:
        """A text or token ids, as the engine takes them."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# Sub-field names worth showing in an error's param; the rest of pydantic's location is union-member noise.
_SUBFIELDS = {"role", "content", "text", "type", "include_usage", "function", "name", "schema", "json_schema"}


def _param(loc: tuple) -> str:
    path = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _SUBFIELDS:
            path += f".{part}"
    return path


def parse(model: type[_Request], body: bytes) -> _Request:
    """The validated request, or an ApiError naming the first bad field."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {first['msg']}") from None
        param = _param(first["loc"]) or None
        where = f"{param}: " if param else ""
        raise ApiError(400, f"{where}{first['msg']}", param=param) from None
    request.check_supported()
    return request
