"""The sampler that turns logits into next tokens (SamplingParams lives in params.py, free of torch)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pagedchat.engine.params import SamplingParams

__all__ = ["Sampler", "SamplingParams"]

log = logging.getLogger("pagedchat.engine")


class Sampler:
    """Picks one token per row of logits. Greedy rows take argmax; others sample with their own generator.

    A row whose sampling raises gets its exception in place of a token, so that it fails its own request alone.
    after_row (the engine's fault hook) runs as each row ends, inside that row's guard."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 after_row: Callable[[int], None] | None = None) -> list[int | Exception]:
        logits = logits.float()
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int | Exception] = []
        for row, (p, gen) in enumerate(zip(params, generators)):
            token: int | Exception
            try:
                token = greedy[row] if p.greedy else _sample_one(logits[row], p, gen)
                if after_row is not None:
                    after_row(row)
            except Exception as exc:
                log.exception("sampling failed for row %d", row)
                token = exc
            out.append(token)
        return out


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop tokens once the mass before them already reaches top_p. The first token always stays, stated
        # rather than left to the comparison: a top_p below float32's smallest number rounds to 0 there.
        drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        drop[0] = False
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    if gen is not None and gen.device != probs.device:
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=gen).item())
