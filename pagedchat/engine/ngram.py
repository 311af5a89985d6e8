"""Draft tokens from a sequence's own text (prompt and reply), for speculative decoding.

The last n tokens (n from n_max down to n_min, the longest match first) are looked up among the sequence's
earlier text, and the up to k tokens that followed their latest earlier occurrence are the draft (vLLM's
`ngram` speculator, llama.cpp's lookup decoding). An index from each n-gram to where it last ended is kept
incrementally, so a lookup costs a few dict probes whether or not it matches, however long the sequence.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, or []."""
        if k <= 0:
            return []
        self.update(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            start = self._last.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []
