"""Token ids to streamed text, incrementally, with stop strings.

Decoding a window [prefix_offset:] and subtracting the text of [prefix_offset:read_offset] keeps word-joining
rules (leading spaces, multi-byte characters split across tokens) right without decoding the whole output
each step. Text that could be the start of a stop string is held back until it is known not to be one.

The Detokenizer keeps each live request's text and offsets (a ReplyText) itself, from its first token to
finish(): a Sequence holds tokens and counters, not decoding state.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedchat.engine.sequence import Sequence


@dataclass
class ReplyText:
    """One request's reply as decoded so far."""

    text: str = ""
    prefix_offset: int = 0   # output ids before the window that step() decodes again
    read_offset: int = 0     # output ids whose text is in `text`
    emitted: int = 0         # characters of text already streamed


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # By the sequence itself, not its id: a refused request may reuse a live one's id.
        self._replies: dict[Sequence, ReplyText] = {}

    def __len__(self) -> int:
        """Requests whose text it keeps: those it has stepped and not yet finished."""
        return len(self._replies)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, seq: Sequence) -> tuple[str, bool]:
        """Fold seq's newest token into its text. Returns (text to stream now, whether a stop string hit)."""
        reply = self._replies.setdefault(seq, ReplyText())
        out = seq.output_ids
        before = self.decode(out[reply.prefix_offset:reply.read_offset])
        after = self.decode(out[reply.prefix_offset:])
        checked_from = len(reply.text)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            reply.text += after[len(before):]
            reply.prefix_offset, reply.read_offset = reply.read_offset, len(out)
        stops = seq.params.stop
        if not stops:
            return self._emit(reply, len(reply.text)), False
        longest = max(len(s) for s in stops)
        hits = [i for s in stops if (i := reply.text.find(s, max(0, checked_from - len(s) + 1))) >= 0]
        if hits:
            reply.text = reply.text[:min(hits)]
            return self._emit(reply, len(reply.text)), True
        return self._emit(reply, len(reply.text) - (longest - 1)), False

    def finish(self, seq: Sequence) -> tuple[str, str]:
        """seq ends: (the text held back so far, to stream now; its whole text). Forgets seq."""
        reply = self._replies.pop(seq, None) or ReplyText()
        return self._emit(reply, len(reply.text)), reply.text

    @staticmethod
    def _emit(reply: ReplyText, upto: int) -> str:
        upto = max(upto, reply.emitted)
        text = reply.text[reply.emitted:upto]
        reply.emitted = upto
        return text
