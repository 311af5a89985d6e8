"""How to pick tokens and when to stop: the one validation of sampling settings. No torch here, so the app and
config can check settings before the engine is loaded."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, make_dataclass
from typing import TYPE_CHECKING

from pagedchat.errors import RequestError

if TYPE_CHECKING:  # a compiled grammar holds llguidance's matcher; params stay free of it at import
    from pagedchat.engine.structured import CompiledGrammar

# Below this, logits / temperature overflows or rounds every probability but one to zero; vLLM clamps at the
# same floor. 0 itself means greedy.
MIN_TEMPERATURE = 0.01
# The seeds torch's generator takes: any whole number that fits in 64 bits, signed or unsigned.
SEED_RANGE = range(-2**63, 2**64)


def sibling_seed(seed: int, sibling: int) -> int:
    """The seed of the sibling-th of n replies to one seeded prompt: the seeds after seed, so that they differ
    and still repeat, wrapping past 2**64 - 1 to 0 onward (modulo 2**64) to stay in SEED_RANGE."""
    following = seed + sibling
    return following - 2**64 if following >= SEED_RANGE.stop else following


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingField:
    """One sampling setting, declared once: SamplingParams' validation, config.toml's [sampling] keys, the chat's
    saved settings, F3's fields, `ask`'s flags, the server's ranges and what the remote backend sends all read it."""

    name: str                    # as SamplingParams, config.toml, the saved chat and OpenAI's API name it
    kind: type                   # int or float (a float setting takes whole numbers too)
    default: object              # SamplingParams' and the API's: what leaves the reply as the model makes it
    rule: str                    # the values allowed, in words: "{name} must be {rule} (got ...)"
    help: str                    # F3's label and the flag's help
    low: float | None = None     # bounds, inclusive unless open
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False       # None allowed: unset
    floor: float | None = None   # values between 0 and this are refused (0 itself is allowed)...
    floor_rule: str = ""         # ...with this rule in words
    chat: bool = False           # a chat keeps it (F3, config.toml's [sampling], the saved chat, `ask`'s flags)
    chat_default: object = None  # a new chat's value where it differs from default (chat fields only)
    openai: bool = True          # OpenAI's API has it; others (vLLM's) go to a server only when not default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def for_chat(self) -> object:
        return self.default if self.chat_default is None else self.chat_default

    def problem(self, value) -> str | None:
        """What is wrong with value for this setting, as one line, or None."""
        if value is None and self.nullable:
            return None
        fits = _is_int(value) if self.kind is int else _is_real(value)
        if fits and self.low is not None:
            fits = value > self.low if self.low_open else value >= self.low
        if fits and self.high is not None:
            fits = value < self.high if self.high_open else value <= self.high
        if fits and self.floor is not None and 0 < value < self.floor:
            return f"{self.name} must be {self.floor_rule} (got {value!r})"
        return None if fits else f"{self.name} must be {self.rule} (got {value!r})"

    def parse(self, text: str):
        """The value a typed text (F3, a flag) stands for; ValueError says what is wrong. Empty: unset."""
        text = text.strip()
        if not text and self.nullable:
            return None
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.rule} (got {text!r})") from None
        problem = self.problem(value)
        if problem:
            raise ValueError(problem)
        return value

    def bounds(self) -> dict:
        """The bounds as pydantic's Field takes them (ge/gt/le/lt)."""
        out = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100]; top_logprobs at most 20.
MAX_PENALTY = 2
MAX_BIAS = 100
MAX_TOP_LOGPROBS = 20

# In F3's order: two a row.
SAMPLING_FIELDS = (
    SamplingField("max_tokens", int, 256, "a whole number of at least 1", "Max tokens", low=1, chat=True,
                  chat_default=1024),
    SamplingField("min_tokens", int, 0, "a whole number >= 0", "Min tokens (0 = off)", low=0, chat=True,
                  openai=False),
    SamplingField("temperature", float, 0.0, "a finite number >= 0", "Temperature (0 = greedy)", low=0, chat=True,
                  chat_default=0.7, floor=MIN_TEMPERATURE, floor_rule=f"0 (greedy) or at least {MIN_TEMPERATURE}"),
    SamplingField("seed", int, None, "a whole number that fits in 64 bits, from -2**63 to 2**64 - 1",
                  "Seed (empty = random)", low=SEED_RANGE.start, high=SEED_RANGE.stop, high_open=True,
                  nullable=True, chat=True),
    SamplingField("top_p", float, 1.0, "in (0, 1]", "Top p", low=0, low_open=True, high=1, chat=True,
                  chat_default=0.95),
    SamplingField("top_k", int, 0, "a whole number >= 0, 0 turns it off", "Top k (0 = off)", low=0, chat=True,
                  openai=False),
    SamplingField("presence_penalty", float, 0.0, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                  "Presence penalty (0 = off)", low=-MAX_PENALTY, high=MAX_PENALTY, chat=True),
    SamplingField("frequency_penalty", float, 0.0, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                  "Frequency penalty (0 = off)", low=-MAX_PENALTY, high=MAX_PENALTY, chat=True),
    SamplingField("repetition_penalty", float, 1.0, "a number > 0, 1 turns it off", "Repetition penalty (1 = off)",
                  low=0, low_open=True, chat=True, openai=False),
)
FIELDS = {f.name: f for f in SAMPLING_FIELDS}
CHAT_FIELDS = tuple(f for f in SAMPLING_FIELDS if f.chat)


def fields_problem(values: dict) -> str | None:
    """The first problem among these declared settings, as one line, or None."""
    for name, value in values.items():
        problem = FIELDS[name].problem(value)
        if problem:
            return problem
    return None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    max_tokens: int = FIELDS["max_tokens"].default
    temperature: float = FIELDS["temperature"].default
    top_p: float = FIELDS["top_p"].default
    top_k: int = FIELDS["top_k"].default
    seed: int | None = FIELDS["seed"].default
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # The logit processors, applied by the sampler in one place (sampling.py), greedy rows included. Presence
    # (OpenAI's): minus it from every token already generated; frequency: minus it times how often; repetition
    # (vLLM's and transformers'): logits of prompt and output tokens divided by it.
    presence_penalty: float = FIELDS["presence_penalty"].default
    frequency_penalty: float = FIELDS["frequency_penalty"].default
    repetition_penalty: float = FIELDS["repetition_penalty"].default
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
    min_tokens: int = FIELDS["min_tokens"].default   # no end-of-sequence or stop id before this many tokens
    stop_token_ids: tuple[int, ...] = ()   # ids that end the reply, beside the model's end-of-sequence ids
    logprobs: int | None = None          # None: none; k: the chosen token's log-probability and the k likeliest
    grammar: CompiledGrammar | None = None   # constrained decoding: only tokens the grammar allows

    def __post_init__(self):
        problem = fields_problem({f.name: getattr(self, f.name) for f in SAMPLING_FIELDS}) or \
            _lists_problem(self.logit_bias, self.stop_token_ids, self.logprobs)
        if problem is None and not all(isinstance(s, str) and s for s in self.stop):
            problem = "stop strings must be non-empty text"
        if problem:
            raise RequestError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether any processor changes this row's logits (a row without one costs the sampler nothing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar is not None)

    def token_ids_used(self) -> list[int]:
        """The token ids the request names, which the engine checks against its vocabulary."""
        return [t for t, _ in self.logit_bias] + list(self.stop_token_ids)


class _Settings:
    """SamplingSettings' behaviour; its fields are the declared chat fields (CHAT_FIELDS)."""

    def __post_init__(self):
        problem = fields_problem(asdict(self))
        if problem:
            raise RequestError(problem)

    def params(self, **overrides) -> SamplingParams:
        return SamplingParams(**{**asdict(self), **overrides})


# Sampling as a user picks it: config.toml's [sampling] defaults, and each chat's own settings (seed None: a fresh
# seed per reply). The same rule as SamplingParams checks it, so no chat holds settings it cannot run.
SamplingSettings = make_dataclass(
    "SamplingSettings", [(f.name, f.kind | None if f.nullable else f.kind, field(default=f.for_chat))
                         for f in CHAT_FIELDS],
    bases=(_Settings,), frozen=True)
SamplingSettings.__module__ = __name__   # where pickle finds it


def _lists_problem(logit_bias=(), stop_token_ids=(), logprobs=None) -> str | None:
    """What is wrong with the settings that are lists or counts of tokens, as one line, or None."""
    for pair in logit_bias:
        if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                and _is_real(pair[1]) and abs(pair[1]) <= MAX_BIAS):
            return f"logit_bias maps token ids >= 0 to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}] (got {pair!r})"
    if not all(_is_int(t) and t >= 0 for t in stop_token_ids):
        return f"stop_token_ids must be token ids >= 0 (got {list(stop_token_ids)!r})"
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        return f"top_logprobs must be a whole number in [0, {MAX_TOP_LOGPROBS}] (got {logprobs!r})"
    return None
