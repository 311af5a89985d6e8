"""Token ids to streamed text, incrementally, with stop strings.

Decoding a window [prefix_offset:] and subtracting the text of [prefix_offset:read_offset] keeps word-joining
rules (leading spaces, multi-byte characters split across tokens) right without decoding the whole output
each step. Text that could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from pagedchat.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, seq: Sequence) -> tuple[str, bool]:
        """Fold seq's newest token into seq.text. Returns (text to stream now, whether a stop string hit)."""
        out = seq.output_ids
        before = self.decode(out[seq.prefix_offset:seq.read_offset])
        after = self.decode(out[seq.prefix_offset:])
        checked_from = len(seq.text)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.text += after[len(before):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(out)
        stops = seq.params.stop
        if not stops:
            return self._emit(seq, len(seq.text)), False
        longest = max(len(s) for s in stops)
        hits = [i for s in stops if (i := seq.text.find(s, max(0, checked_from - len(s) + 1))) >= 0]
        if hits:
            seq.text = seq.text[:min(hits)]
            return self._emit(seq, len(seq.text)), True
        return self._emit(seq, len(seq.text) - (longest - 1)), False

    def flush(self, seq: Sequence) -> str:
        return self._emit(seq, len(seq.text))

    @staticmethod
    def _emit(seq: Sequence, upto: int) -> str:
        upto = max(upto, seq.emitted)
        text = seq.text[seq.emitted:upto]
        seq.emitted = upto
        return text
