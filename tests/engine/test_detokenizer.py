"""The incremental detokenizer alone: streamed pieces add up to the whole decode, a character split across
tokens waits for its last byte, and stop strings cut the text and hold back what could start one."""

from __future__ import annotations

from pagedchat.engine.detokenizer import Detokenizer
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.sequence import Sequence
from tiny_models import make_tokenizer

PROMPT = [1, 2, 3]


class ByteTokenizer:
    """Token id = one UTF-8 byte, decoded as a byte-level BPE tokenizer decodes an incomplete character."""

    @staticmethod
    def decode(ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(tokenizer, output: list[int], stop: list[str] = ()) -> tuple[list[str], bool, Sequence]:
    """Feed output one token at a time as the engine does; the pieces streamed, whether a stop hit, and the
    sequence (flushed)."""
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(stop=list(stop)))
    det = Detokenizer(tokenizer)
    pieces = []
    for token in output:
        seq.token_ids.append(token)
        text, stopped = det.step(seq)
        pieces.append(text)
        if stopped:
            break
    pieces.append(det.flush(seq))
    return pieces, stopped, seq


def test_pieces_add_up_to_decoding_the_whole_output():
    tok = make_tokenizer()
    text = "Paged attention keeps K/V in pages, and pages can be shared!"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, stopped, seq = stream(tok, ids)
    assert "".join(pieces) == seq.text == tok.decode(ids, skip_special_tokens=True)
    assert not stopped and sum(1 for p in pieces if p) > 5, "the text streams in many pieces, not at the end"


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    ids = list("né€".encode())  # n, then é in 2 bytes, then € in 3
    pieces, _, _ = stream(ByteTokenizer(), ids)
    assert pieces == ["n", "", "é", "", "", "€", ""]
    assert "\ufffd" not in "".join(pieces)


def test_a_stop_string_cuts_the_text_and_ends_the_request():
    pieces, stopped, seq = stream(ByteTokenizer(), list(b"one two STOP three"), stop=["STOP"])
    assert stopped and seq.text == "one two " and "".join(pieces) == "one two "
    assert len(seq.output_ids) == len("one two STOP"), "nothing is decoded past the stop"


def test_the_last_characters_wait_as_long_as_a_stop_string_could_still_start_there():
    """Up to len(longest stop) - 1 characters are held back each step; the request's end flushes them."""
    pieces, stopped, seq = stream(ByteTokenizer(), list(b"a ST"), stop=["STOP"])
    assert not stopped and pieces == ["", "", "", "a", " ST"]
    assert "".join(pieces) == seq.text == "a ST"


def test_the_earliest_of_several_stop_strings_wins():
    _, stopped, seq = stream(ByteTokenizer(), list(b"xx END yy HALT"), stop=["HALT", "END"])
    assert stopped and seq.text == "xx "
