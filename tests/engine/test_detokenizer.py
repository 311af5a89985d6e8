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


def stream(tokenizer, output: list[int], stop: list[str] = ()) -> tuple[list[str], bool, str, Sequence]:
    """Feed output one token at a time as the engine does, then finish; the pieces streamed (the last what
    finish flushed), whether a stop hit, the whole text and the sequence."""
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(stop=list(stop)))
    det = Detokenizer(tokenizer)
    pieces = []
    for token in output:
        seq.token_ids.append(token)
        text, stopped = det.step(seq)
        pieces.append(text)
        if stopped:
            break
    rest, text = det.finish(seq)
    pieces.append(rest)
    assert len(det) == 0, "a finished request's text is not kept"
    return pieces, stopped, text, seq


def test_pieces_add_up_to_decoding_the_whole_output():
    tok = make_tokenizer()
    text = "Paged attention keeps K/V in pages, and pages can be shared!"
    ids = tok.encode(text, add_special_tokens=False)
    pieces, stopped, text, _ = stream(tok, ids)
    assert "".join(pieces) == text == tok.decode(ids, skip_special_tokens=True)
    assert not stopped and sum(1 for p in pieces if p) > 5, "the text streams in many pieces, not at the end"


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    ids = list("né€".encode())  # n, then é in 2 bytes, then € in 3
    pieces, *_ = stream(ByteTokenizer(), ids)
    assert pieces == ["n", "", "é", "", "", "€", ""]
    assert "\ufffd" not in "".join(pieces)


def test_a_stop_string_cuts_the_text_and_ends_the_request():
    pieces, stopped, text, seq = stream(ByteTokenizer(), list(b"one two STOP three"), stop=["STOP"])
    assert stopped and text == "one two " and "".join(pieces) == "one two "
    assert len(seq.output_ids) == len("one two STOP"), "nothing is decoded past the stop"


def test_the_last_characters_wait_as_long_as_a_stop_string_could_still_start_there():
    """Up to len(longest stop) - 1 characters are held back each step; the request's end flushes them."""
    pieces, stopped, text, _ = stream(ByteTokenizer(), list(b"a ST"), stop=["STOP"])
    assert not stopped and pieces == ["", "", "", "a", " ST"]
    assert "".join(pieces) == text == "a ST"


def test_the_earliest_of_several_stop_strings_wins():
    _, stopped, text, _ = stream(ByteTokenizer(), list(b"xx END yy HALT"), stop=["HALT", "END"])
    assert stopped and text == "xx "


def test_two_requests_decode_apart_and_a_finished_one_is_forgotten():
    """Each request's offsets are its own: interleaved steps decode each as if alone."""
    det = Detokenizer(ByteTokenizer())
    a = Sequence("a", list(PROMPT), len(PROMPT), SamplingParams())
    b = Sequence("a", list(PROMPT), len(PROMPT), SamplingParams())  # the same id: still another request
    streamed = {a: "", b: ""}
    for x, y in zip("né€".encode(), "añb!!".encode()):
        for seq, token in ((a, x), (b, y)):
            seq.token_ids.append(token)
            streamed[seq] += det.step(seq)[0]
    assert (streamed[a], streamed[b]) == ("né€", "añb!!") and len(det) == 2
    assert det.finish(a) == ("", "né€") and len(det) == 1
