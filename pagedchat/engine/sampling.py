"""Sampling parameters and the sampler that turns logits into next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 turns it off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks one token per row of logits. Greedy rows take argmax; others sample with their own generator."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        logits = logits.float()
        out = logits.argmax(dim=-1).tolist()
        for row, (p, gen) in enumerate(zip(params, generators)):
            if not p.greedy:
                out[row] = _sample_one(logits[row], p, gen)
        return out


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p; the first token always stays.
        drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    if gen is not None and gen.device != probs.device:
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=gen).item())
