"""How to pick tokens and when to stop: the one validation of sampling settings. No torch here, so the app and
config can check settings before the engine is loaded."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pagedchat.errors import RequestError

if TYPE_CHECKING:  # a compiled grammar holds llguidance's matcher; params stay free of it at import
    from pagedchat.engine.structured import CompiledGrammar

# Below this, logits / temperature overflows or rounds every probability but one to zero; vLLM clamps at the
# same floor. 0 itself means greedy.
MIN_TEMPERATURE = 0.01
# The seeds torch's generator takes: any whole number that fits in 64 bits, signed or unsigned.
SEED_RANGE = range(-2**63, 2**64)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # The logit processors, applied by the sampler in one place (sampling.py), greedy rows included.
    presence_penalty: float = 0.0        # OpenAI's: minus this from every token already generated
    frequency_penalty: float = 0.0       # OpenAI's: minus this times how often a token was generated
    repetition_penalty: float = 1.0      # vLLM's and transformers': logits of prompt and output tokens / this
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
    min_tokens: int = 0                  # no end-of-sequence or stop id before this many tokens
    stop_token_ids: tuple[int, ...] = ()   # ids that end the reply, beside the model's end-of-sequence ids
    logprobs: int | None = None          # None: none; k: the chosen token's log-probability and the k likeliest
    grammar: CompiledGrammar | None = None   # constrained decoding: only tokens the grammar allows

    def __post_init__(self):
        problem = sampling_problem(self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed) or \
            processor_problem(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                              self.logit_bias, self.min_tokens, self.stop_token_ids, self.logprobs)
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


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling as a user picks it: config.toml's [sampling] defaults, and each chat's own settings (seed None: a
    fresh seed per reply). The same rule as SamplingParams checks it, so no chat holds settings it cannot run."""

    max_tokens: int = 1024
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        problem = sampling_problem(self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed)
        if problem:
            raise RequestError(problem)

    def params(self, **overrides) -> SamplingParams:
        return SamplingParams(**{**asdict(self), **overrides})


def sampling_problem(max_tokens, temperature, top_p, top_k, seed=None) -> str | None:
    """What is wrong with these settings, as one line, or None: shared by requests, config.toml and the F3 form."""
    if not _is_int(max_tokens) or max_tokens < 1:
        return f"max_tokens must be a whole number of at least 1 (got {max_tokens!r})"
    if not _is_real(temperature) or temperature < 0:
        return f"temperature must be a finite number >= 0 (got {temperature!r})"
    if 0 < temperature < MIN_TEMPERATURE:
        return f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE} (got {temperature!r})"
    if not _is_real(top_p) or not 0 < top_p <= 1:
        return f"top_p must be in (0, 1] (got {top_p!r})"
    if not _is_int(top_k) or top_k < 0:
        return f"top_k must be a whole number >= 0, 0 turns it off (got {top_k!r})"
    if seed is not None and (not _is_int(seed) or seed not in SEED_RANGE):
        return f"seed must be a whole number that fits in 64 bits, from -2**63 to 2**64 - 1 (got {seed!r})"
    return None


# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100]; top_logprobs at most 20.
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_TOP_LOGPROBS = 20


def processor_problem(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=(),
                      min_tokens=0, stop_token_ids=(), logprobs=None) -> str | None:
    """What is wrong with the logit processors' settings, as one line, or None."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _is_real(value) or abs(value) > MAX_PENALTY:
            return f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (got {value!r})"
    if not _is_real(repetition_penalty) or repetition_penalty <= 0:
        return f"repetition_penalty must be a number > 0, 1 turns it off (got {repetition_penalty!r})"
    for pair in logit_bias:
        if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                and _is_real(pair[1]) and abs(pair[1]) <= MAX_BIAS):
            return f"logit_bias maps token ids >= 0 to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}] (got {pair!r})"
    if not _is_int(min_tokens) or min_tokens < 0:
        return f"min_tokens must be a whole number >= 0 (got {min_tokens!r})"
    if not all(_is_int(t) and t >= 0 for t in stop_token_ids):
        return f"stop_token_ids must be token ids >= 0 (got {list(stop_token_ids)!r})"
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        return f"top_logprobs must be a whole number in [0, {MAX_TOP_LOGPROBS}] (got {logprobs!r})"
    return None
