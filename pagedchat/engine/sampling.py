"""The sampler that turns logits into next tokens (SamplingParams lives in params.py, free of torch).

Each row's logit processors run here and only here, in one order: repetition penalty, presence and frequency
penalties, logit bias, min_tokens, then the grammar's mask. Greedy rows go through them too. Log-probabilities
are read from the logits after the processors (so after the mask, as vLLM does) and before temperature.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from pagedchat.engine.params import SamplingParams
from pagedchat.engine.records import Sampled, TokenLogprob
from pagedchat.model import qmm

log = logging.getLogger("pagedchat.engine")

BIAS_CACHE = 256   # requests' logit_bias tensors kept: more than a batch runs at once
NOT_SAMPLED = -1   # the token of a row after a refused draft token, which the engine discards
NUCLEUS_FIRST_LOOK = 128   # best tokens in which top_p's nucleus is looked for first: a chat model's usually fits
NUCLEUS_WIDENING = 8       # how many times more tokens the next look takes when it did not fit


@dataclass(frozen=True)
class Row:
    """One row of logits to sample from, with what its processors need."""

    params: SamplingParams
    generator: torch.Generator | None = None
    token_ids: Sequence[int] = ()   # prompt then output: the repetition penalty reads both
    num_prompt_tokens: int = 0
    matcher: object | None = None   # llguidance.LLMatcher when the reply is constrained
    draft: int | None = None        # the draft token proposed at this position, which the row verifies

    @property
    def output_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class Sampler:
    """Picks one token per row of logits. Greedy rows take argmax; others sample with their own generator.
    A row verifying a draft token d samples as any row, and d is kept if it is the token drawn: kept with
    probability p(d), and else the token is drawn from p without d, speculative sampling's rule for a draft that
    proposes d with certainty. The sequence's rows after a refused one draw nothing, so a seeded request draws
    the same numbers, and picks the same tokens, with speculation as without.
    A row whose processing or sampling raises gets its exception in place of a token, so that it fails its own
    request alone; after_row (the engine's fault hook) runs as each row ends, inside that row's guard.
    end_ids: the model's end-of-sequence ids, which min_tokens holds back."""

    end_ids: frozenset[int] = field(default_factory=frozenset)
    # Each request's logit_bias as (ids, values) tensors, made once rather than at every step: keyed by the
    # params' id, with the params kept so that the id cannot be reused while the entry lives.
    _biases: OrderedDict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = \
        field(default_factory=OrderedDict, repr=False)

    def __call__(self, logits: torch.Tensor, rows: list[Row],
                 after_row: Callable[[int], None] | None = None) -> list[Sampled | Exception]:
        logits = logits.float()
        failed: dict[int, Exception] = {}
        shaped = [i for i, r in enumerate(rows) if r.params.shapes_logits]
        if shaped:
            logits = logits.clone()  # the runner's buffer stays as the model left it
            for i in shaped:
                try:
                    self._process(logits[i], rows[i])
                except Exception as exc:
                    failed[i] = exc
            constrained = [i for i in shaped if rows[i].matcher is not None and i not in failed]
            if constrained:
                try:
                    apply_masks(logits, constrained, [rows[i].matcher for i in constrained])
                except Exception as exc:
                    failed.update(dict.fromkeys(constrained, exc))
        picks = qmm.argmax_rows(logits).tolist()
        out: list[Sampled | Exception] = []
        refused = None  # the generator of the sequence whose draft the last row refused
        for i, row in enumerate(rows):
            sampled: Sampled | Exception
            if row.generator is not None and row.generator is refused:
                out.append(Sampled(NOT_SAMPLED))  # after a refused draft token: discarded, so nothing is drawn
                continue
            try:
                if i in failed:
                    raise failed[i]
                token = picks[i] if row.params.greedy else _sample_one(logits[i], row.params, row.generator)
                sampled = self._result(logits[i], row, token)
                if row.draft is not None and token != row.draft:
                    refused = row.generator
                if after_row is not None:
                    after_row(i)
            except Exception as exc:
                log.exception("sampling failed for row %d", i)
                sampled = exc
            out.append(sampled)
        return out

    def _process(self, logits: torch.Tensor, row: Row) -> None:
        p = row.params
        if p.repetition_penalty != 1.0 and row.token_ids:
            seen = torch.tensor(sorted(set(row.token_ids)), device=logits.device)
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            # Over the tokens the reply holds, not the vocabulary: the cost is the sender's.
            ids, counts = torch.unique(torch.tensor(list(row.output_ids)), return_counts=True)
            inside = ids < logits.numel()
            counts = counts[inside].to(logits.device, logits.dtype)
            logits[ids[inside].to(logits.device)] -= p.frequency_penalty * counts + p.presence_penalty
        if p.logit_bias:
            ids, values = self._bias(p)
            inside = ids < logits.numel()
            logits.index_add_(0, ids[inside].to(logits.device), values[inside].to(logits.device))
        # A grammar that is complete allows only the end, and wins over min_tokens (else no token were left).
        if len(row.output_ids) < p.min_tokens and not (row.matcher is not None and row.matcher.is_stopped()):
            ends = [t for t in (*self.end_ids, *p.stop_token_ids) if t < logits.numel()]
            logits[ends] = float("-inf")

    def _bias(self, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._biases.get(id(p))
        if entry is None or entry[0] is not p:
            ids, values = zip(*p.logit_bias)
            entry = self._biases[id(p)] = (p, torch.tensor(ids), torch.tensor(values, dtype=torch.float32))
            while len(self._biases) > BIAS_CACHE:
                self._biases.popitem(last=False)
        self._biases.move_to_end(id(p))
        return entry[1], entry[2]

    @staticmethod
    def _result(logits: torch.Tensor, row: Row, token: int) -> Sampled:
        error = None
        if row.matcher is not None and not row.matcher.consume_token(token):
            error = f"the grammar refused token {token}: {row.matcher.get_error()}"
        k = row.params.logprobs
        if k is None:
            return Sampled(token, error=error)
        logprobs = logits.log_softmax(-1)
        chosen = TokenLogprob(token, float(logprobs[token]))
        top = ()
        if k:
            values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
            top = tuple(TokenLogprob(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist())
                        if v > float("-inf"))  # a mask may leave fewer than k tokens possible
        return Sampled(token, chosen, top, error)


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set to -inf, in place, each listed row's logits of the tokens its matcher forbids next."""
    # llguidance's numpy helpers: its torch ones import torch.compile's machinery (seconds, on the engine thread).
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = logits.shape[-1]
    bitmask = allocate_token_bitmask(len(rows), vocab)
    for i, matcher in enumerate(matchers):
        fill_next_token_bitmask(matcher, bitmask, i)
    # Bit b of 32-bit word w allows token 32w + b: read as little-endian bytes, numpy unpacks them in that order.
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(bits == 0).to(logits.device)
    for i, row in enumerate(rows):
        logits[row].masked_fill_(forbidden[i], float("-inf"))


def _sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token drawn from the softmax of logits / temperature, kept to the top k and then to the nucleus of
    top_p: the smallest run of best tokens whose mass reaches it. Sorting the whole vocabulary, and torch's
    multinomial, cost many times a small model's step; so the nucleus is looked for among the best few tokens
    first, and one uniform number picks the token from the kept tokens' cumulative mass."""
    logits = logits / p.temperature
    n = logits.numel()
    k = min(p.top_k or n, n)
    if k == n and p.top_p >= 1.0:
        return _draw(logits.softmax(-1), gen)
    values, ids, total = _best(logits, k, p.top_p)
    probs = (values - total).exp()
    if p.top_p < 1.0:
        # Keep tokens while the mass before them is short of top_p. The first token always stays, stated rather
        # than left to the comparison: a top_p below float32's smallest number rounds to 0 there.
        short = int(((probs.cumsum(0) - probs) < p.top_p).sum())
        probs = probs[:max(short, 1)]
    return int(ids[_draw(probs, gen)])


def _best(logits: torch.Tensor, k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k best logits and their ids, best first, and the log of the mass they are drawn from: the top k's,
    or the whole vocabulary's without top_k, where only as many are taken as the nucleus needs."""
    n = logits.numel()
    if k < n or top_p >= 1.0:
        values, ids = torch.topk(logits, k)
        return values, ids, torch.logsumexp(values, 0)
    total = torch.logsumexp(logits, 0)
    m = NUCLEUS_FIRST_LOOK
    while True:
        values, ids = torch.topk(logits, min(m, n))
        # Past these m tokens, the mass before any other already reaches top_p, so the nucleus lies within.
        if m >= n or float((values - total).exp().sum()) >= top_p:
            return values, ids, total
        m *= NUCLEUS_WIDENING


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """An index drawn with probability proportional to probs, from one uniform number of gen."""
    cdf = probs.cumsum(0)
    if not cdf[-1] > 0:  # every token masked (or NaN logits): multinomial's error, said plainly
        raise ValueError("no token can be drawn: every token's probability is 0 or NaN")
    u = torch.rand((), generator=gen, device=gen.device if gen is not None else "cpu").to(cdf.device)
    # The first index whose cumulative mass exceeds u: a token of zero mass is never picked.
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.numel() - 1)
