"""Draft tokens from a sequence's own text (prompt and reply), for speculative decoding.

The last n tokens (n from n_max down to n_min, the longest match first) are looked up among the sequence's
earlier text, and the up to k tokens that followed their latest earlier occurrence are the draft (vLLM's
`ngram` speculator, llama.cpp's lookup decoding), no more of them than the tokens that agree before it: a long
match is text being copied, a short one often a common phrase. An index from each n-gram to where it last ended is kept
incrementally, so a lookup costs a few dict probes whether or not it matches, however long the sequence.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedchat.engine.sequence import Sequence


@dataclass
class NgramIndex:
    """Where each n-gram of a token list last ended with a token after it. Tokens are only ever appended."""

    n_min: int = 2
    n_max: int = 4
    _last: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)  # n-gram -> index after it
    _indexed: int = 0   # tokens whose preceding n-grams are in _last (every n-gram followed by a known token)

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that end before each token added since the last call."""
        for end in range(max(self._indexed, self.n_min), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._last[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def match(self, tokens: list[int], longest: int) -> Match | None:
        """The latest earlier occurrence of the longest matching suffix (n_max down to n_min tokens), with how
        many tokens, up to longest, agree before it and the text's end."""
        self.update(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            start = self._last.get(tuple(tokens[-n:]))
            if start is not None:
                length = n
                while length < longest and length < start and tokens[start - length - 1] == tokens[-length - 1]:
                    length += 1
                return Match(start, length)
        return None

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, or []."""
        found = self.match(tokens, 0) if k > 0 else None
        return [] if found is None else tokens[found.start:found.start + k]


@dataclass(frozen=True)
class Match:
    start: int    # where the tokens that followed the earlier occurrence begin
    length: int   # the tokens before start that equal the text's last ones


SPECULATIVE_MODES = ("auto", "ngram", "off")
# auto drafts while this many sequences or fewer run: a step of so few rows is bound by reading the weights, so
# a few more rows cost little; a larger batch is bound by compute, where rejected rows cost their full share.
AUTO_MAX_RUNNING = 4


def parse_speculative(mode: str | None) -> str:
    """A `speculative` setting checked: auto (the default), ngram (whatever the batch) or off."""
    mode = "auto" if mode is None else str(mode).lower()
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)} (got {mode!r})")
    return mode


@dataclass
class Drafter:
    """One sequence's drafting state: the index of its tokens, and its next draft's length (None: k)."""

    ngrams: NgramIndex
    draft_len: int | None = None


@dataclass
class Speculation:
    """When and what a decoding sequence drafts (the scheduler asks at each step, and forgets a sequence when it
    ends). It keeps each sequence's Drafter, by the sequence itself, from its first draft on."""

    mode: str = "auto"
    k: int = 16                  # draft tokens at most
    n_min: int = 2
    n_max: int = 4
    max_context: int = 2**62     # positions the model has: a draft never runs past them
    _drafters: dict[Sequence, Drafter] = field(default_factory=dict, init=False, repr=False)

    def __len__(self) -> int:
        """Sequences it keeps a drafter for: those that drafted and have not ended."""
        return len(self._drafters)

    def _drafter(self, seq: Sequence) -> Drafter:
        if seq not in self._drafters:
            self._drafters[seq] = Drafter(NgramIndex(self.n_min, self.n_max))
        return self._drafters[seq]

    def forget(self, seq: Sequence) -> None:
        self._drafters.pop(seq, None)

    def active(self, running: int) -> bool:
        return self.mode == "ngram" or (self.mode == "auto" and running <= AUTO_MAX_RUNNING)

    def room(self, seq: Sequence) -> int:
        """The most draft tokens seq takes now: its adaptive length, and no token past max_tokens or the
        context; 0 for a row whose logits depend on more than the model (processors, a grammar) or that
        reports log-probabilities, for which the sampler verifies nothing."""
        p = seq.params
        if p.shapes_logits or p.logprobs is not None or seq.matcher is not None:
            return 0
        left = min(p.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens), self.max_context - len(seq.token_ids))
        drafter = self._drafters.get(seq)
        draft_len = None if drafter is None else drafter.draft_len
        return max(0, min(self.k if draft_len is None else draft_len, left - 1))

    def draft(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens, and no more than the match is long: a text that agrees with an earlier passage over
        a dozen tokens goes on copying it far more often than one that shares two tokens with it."""
        if k <= 0:
            return []
        found = self._drafter(seq).ngrams.match(seq.token_ids, k)
        return [] if found is None else seq.token_ids[found.start:found.start + min(k, found.length)]

    def settle(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """After a verification: the next draft as long as this one's accepted run and one more (twice as long
        when all of it was taken), so a sequence whose text stops matching wastes little."""
        self._drafter(seq).draft_len = min(self.k, 2 * drafted if accepted == drafted else accepted + 1)
