"""The sampler that turns logits into next tokens (SamplingParams lives in params.py, free of torch)."""

from __future__ import annotations

import torch

from pagedchat.engine.params import SamplingParams

__all__ = ["Sampler", "SamplingParams"]


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
