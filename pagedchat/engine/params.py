"""How to pick tokens and when to stop: the one validation of sampling settings. No torch here, so the app and
config can check settings before the engine is loaded."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from pagedchat.errors import RequestError

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

    def __post_init__(self):
        problem = sampling_problem(self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed)
        if problem is None and not all(isinstance(s, str) and s for s in self.stop):
            problem = "stop strings must be non-empty text"
        if problem:
            raise RequestError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
