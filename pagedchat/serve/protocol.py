"""The OpenAI request bodies `pagedchat serve` accepts, and the error it answers a bad one with.

Validation is strict about the fields it knows (types, ranges, finite numbers) and ignores the ones it does not,
as vLLM does: OpenAI clients and editors send vendor fields freely, and refusing them would break those clients.
Known fields whose effect the engine cannot give (n > 1, logprobs, tools, penalties) are refused unless left at
their no-op value, so a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedchat.engine.params import SEED_RANGE, SamplingParams


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
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


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict:
        """The {"role", "content"} the chat template takes; OpenAI's newer "developer" role is the system one."""
        role = "system" if self.role == "developer" else self.role
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": role, "content": content}


class StreamOptions(_Body):
    include_usage: bool = False


class _Request(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)       # OpenAI's default: sampling, not greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)                # vLLM's extra field; -1 and 0 both turn it off
    seed: int | None = Field(None, ge=SEED_RANGE.start, lt=SEED_RANGE.stop)   # what torch's generator takes
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                    # vLLM's extra field; the bench forces replies to a fixed length
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        """Refuse what the engine cannot do, naming the field."""
        if self.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported; leave it at 0", param=name)
        if any(not s for s in self.stop_strings):
            raise ApiError(400, "a stop string must not be empty", param="stop")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop=self.stop_strings,
                              ignore_eos=self.ignore_eos)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # OpenAI's newer name for max_tokens
    logprobs: bool = False
    tools: list[dict] | None = None
    response_format: dict | None = None
    # vLLM's extra fields: continue the last (assistant) message rather than answer after it. The app's fork of
    # a live reply over HTTP sends the reply so far this way.
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise ApiError(400, "only the text response_format is supported", param="response_format")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ApiError(400, "continue_final_message needs add_generation_prompt false and an assistant "
                           "message last", param="continue_final_message")
        if not self.continue_final_message and not self.add_generation_prompt:
            raise ApiError(400, "add_generation_prompt false is supported only with continue_final_message",
                           param="add_generation_prompt")

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    max_tokens: int | None = Field(16, ge=1)    # the legacy endpoint's default is 16 tokens

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            raise ApiError(400, "one prompt per request is supported", param="prompt")
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported", param=name)

    def prompt_input(self) -> str | list[int]:
        """A text or token ids, as the engine takes them."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# Sub-field names worth showing in an error's param; the rest of pydantic's location is union-member noise.
_SUBFIELDS = {"role", "content", "text", "type", "include_usage"}


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
