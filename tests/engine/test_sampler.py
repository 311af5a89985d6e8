"""The sampler alone: greedy rows, temperature, top-k and top-p, and seeded generators."""

from __future__ import annotations

import math
from collections import Counter

import torch

from pagedchat.engine.params import SamplingParams
from pagedchat.engine.sampling import Row, Sampler

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def draws(params: SamplingParams, n: int, seed: int = 0, logits: torch.Tensor = LOGITS) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [Sampler()(logits[None], [Row(params, gen)])[0].token for _ in range(n)]


def pick(logits: torch.Tensor, rows: list[Row], sampler: Sampler | None = None) -> list[int]:
    return [s.token for s in (sampler or Sampler())(logits, rows)]


def test_greedy_rows_take_the_argmax_and_need_no_generator():
    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0])])
    assert pick(logits, [Row(SamplingParams())] * 3) == [1, 3, 2]


def test_a_greedy_tie_goes_to_the_first_of_the_tied_tokens_over_a_whole_vocabulary():
    """transformers' greedy pick is argmax's: the lowest id among equal logits, at any vocabulary size."""
    logits = torch.zeros(3, 49152)
    logits[0, [40000, 7, 30000]] = 5.0
    logits[1, [49151, 20000]] = 1.0
    assert pick(logits, [Row(SamplingParams())] * 3) == [7, 20000, 0]


def test_low_precision_logits_are_sampled_in_float32():
    assert pick(LOGITS[None].to(torch.bfloat16), [Row(SamplingParams())]) == [1]


def test_rows_mix_greedy_and_sampled():
    hot = SamplingParams(temperature=1.0, top_k=1)
    assert pick(torch.stack([LOGITS, LOGITS]), [Row(SamplingParams()), Row(hot, torch.Generator().manual_seed(1))]) \
        == [1, 1]


def test_top_k_keeps_only_the_k_best():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2), 300)) == {1, 4}
    assert set(draws(SamplingParams(temperature=1.0, top_k=1), 50)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p_and_always_the_best():
    probs = LOGITS.softmax(-1)
    best_two = float(probs[1] + probs[4])  # 3.0 and 2.9: the first two in order
    assert set(draws(SamplingParams(temperature=1.0, top_p=best_two - 1e-3), 300)) == {1, 4}
    assert set(draws(SamplingParams(temperature=1.0, top_p=1e-6), 50)) == {1}


def test_temperature_follows_the_softmax():
    """Two tokens with logits 0 and ln 3: at temperature 1 they come 1:3; at 0.5 (logits doubled) 1:9."""
    logits = torch.tensor([0.0, math.log(3.0)])
    for temperature, share in ((1.0, 0.75), (0.5, 0.9)):
        counts = Counter(draws(SamplingParams(temperature=temperature), 4000, logits=logits))
        assert abs(counts[1] / 4000 - share) < 0.03, (temperature, counts)


def test_a_seeded_generator_repeats_and_another_seed_differs():
    params = SamplingParams(temperature=1.5)
    assert draws(params, 40, seed=7) == draws(params, 40, seed=7)
    assert draws(params, 40, seed=7) != draws(params, 40, seed=8)


def test_a_top_p_below_float32s_smallest_number_keeps_the_best_token():
    """7e-46 rounds to 0 in float32, where every token's preceding mass "reaches" it: the best token stays."""
    assert set(draws(SamplingParams(temperature=1.0, top_p=7e-46), 20)) == {1}
    assert set(draws(SamplingParams(temperature=0.01, top_p=5e-324, top_k=2**70), 20)) == {1}


def test_top_p_within_top_k_weighs_only_the_k_kept():
    """top_p's mass is the top k's renormalised: the best two of three reach it, though not of all five."""
    probs = LOGITS.softmax(-1)
    within_three = float((probs[1] + probs[4]) / (probs[1] + probs[4] + probs[2]))
    assert float(probs[1] + probs[4]) < within_three - 2e-3
    assert set(draws(SamplingParams(temperature=1.0, top_k=3, top_p=within_three - 1e-3), 300)) == {1, 4}


def test_a_wide_nucleus_is_drawn_from_whole():
    """A nearly flat vocabulary: top_p's nucleus holds thousands of tokens, past the first few the sampler looks
    at, and every draw lies in the nucleus that sorting the whole vocabulary gives."""
    logits = -torch.arange(49152, dtype=torch.float32) * 1e-5
    probs = logits.softmax(-1)
    nucleus = int(((probs.cumsum(-1) - probs) < 0.5).sum())
    drawn = draws(SamplingParams(temperature=1.0, top_p=0.5), 400, logits=logits)
    assert max(drawn) < nucleus
    assert max(drawn) > nucleus * 0.9 and len(set(drawn)) > 390


def test_a_row_with_every_token_masked_fails_alone():
    masked = torch.full((5,), float("-inf"))
    hot = SamplingParams(temperature=1.0)
    out = Sampler()(torch.stack([masked, LOGITS]), [Row(hot, torch.Generator().manual_seed(0)), Row(hot)])
    assert isinstance(out[0], ValueError) and "no token can be drawn" in str(out[0])
    assert out[1].token in range(5)


def test_a_row_whose_sampling_raises_gets_its_exception_and_the_others_their_tokens():
    def second_row_breaks(row: int) -> None:
        if row == 1:
            raise RuntimeError("row 1 broke")

    hot = SamplingParams(temperature=1.0, top_k=1)
    rows = Sampler()(torch.stack([LOGITS, LOGITS, LOGITS]),
                     [Row(SamplingParams()), Row(hot, torch.Generator().manual_seed(1)),
                      Row(hot, torch.Generator().manual_seed(1))],
                     after_row=second_row_breaks)
    assert rows[0].token == 1 and rows[2].token == 1
    assert isinstance(rows[1], RuntimeError) and str(rows[1]) == "row 1 broke"


# ---- the logit processors: each changes the pick, greedy rows included -------------------------------------
def test_logit_bias_moves_the_greedy_pick():
    assert pick(LOGITS[None], [Row(SamplingParams(logit_bias=((1, -100.0),)))]) == [4]
    assert pick(LOGITS[None], [Row(SamplingParams(logit_bias=((3, 5.0),)))]) == [3]


def test_presence_and_frequency_penalties_count_only_the_output():
    # Token 1 (3.0) was generated twice: frequency 0.1 leaves it first (2.8 > 2.9? no: 2.8 < 2.9), so 4 wins.
    row = Row(SamplingParams(frequency_penalty=0.1), token_ids=[0, 1, 1], num_prompt_tokens=1)
    assert pick(LOGITS[None], [row]) == [4]
    assert pick(LOGITS[None], [Row(SamplingParams(presence_penalty=0.2), token_ids=[0, 1], num_prompt_tokens=1)]) == [4]
    # The same tokens in the prompt only: no penalty.
    assert pick(LOGITS[None], [Row(SamplingParams(presence_penalty=2.0), token_ids=[1, 1], num_prompt_tokens=2)]) == [1]


def test_repetition_penalty_reads_prompt_and_output_and_divides_positive_logits():
    row = Row(SamplingParams(repetition_penalty=1.2), token_ids=[1], num_prompt_tokens=1)
    assert pick(LOGITS[None], [row]) == [4]          # 3.0 / 1.2 = 2.5 < 2.9
    negative = torch.tensor([-1.0, -1.1])
    row = Row(SamplingParams(repetition_penalty=2.0), token_ids=[0], num_prompt_tokens=1)
    assert pick(negative[None], [row]) == [1]        # -1.0 * 2 = -2.0 < -1.1


def test_min_tokens_holds_back_end_and_stop_ids_until_reached():
    sampler = Sampler(end_ids=frozenset({1}))
    early = Row(SamplingParams(min_tokens=2, stop_token_ids=(4,)), token_ids=[0, 2], num_prompt_tokens=1)
    assert pick(LOGITS[None], [early], sampler) == [2]
    done = Row(SamplingParams(min_tokens=1, stop_token_ids=(4,)), token_ids=[0, 2], num_prompt_tokens=1)
    assert pick(LOGITS[None], [done], sampler) == [1]


def test_a_row_without_processors_is_left_alone_beside_one_with_them():
    rows = [Row(SamplingParams()), Row(SamplingParams(logit_bias=((1, -100.0),)))]
    assert pick(torch.stack([LOGITS, LOGITS]), rows) == [1, 4]


def test_logprobs_are_the_log_softmax_after_the_processors():
    [plain] = Sampler()(LOGITS[None], [Row(SamplingParams(logprobs=2))])
    expected = LOGITS.log_softmax(-1)
    assert plain.token == 1 and math.isclose(plain.logprob.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t.token_id for t in plain.top] == [1, 4]
    [biased] = Sampler()(LOGITS[None], [Row(SamplingParams(logprobs=0, logit_bias=((1, -100.0),)))])
    assert biased.token == 4 and biased.top == ()
    assert math.isclose(biased.logprob.logprob, float((LOGITS - 100.0 * (torch.arange(5) == 1)).log_softmax(-1)[4]),
                        rel_tol=1e-6)
    assert Sampler()(LOGITS[None], [Row(SamplingParams())])[0].logprob is None


def test_a_grammar_mask_allows_only_what_the_grammar_accepts():
    """A choice grammar over the tiny tokenizer: greedy and sampled rows only ever spell one of the choices."""
    from pagedchat.engine.structured import GrammarCompiler, GrammarKind, GrammarSpec
    from tiny_models import VOCAB_SIZE, make_tokenizer

    tok = make_tokenizer()
    compiler = GrammarCompiler(tok, VOCAB_SIZE, tok.eos_token_id)
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "(fox|dog)"))
    assert compiler.compile(GrammarSpec(GrammarKind.REGEX, "(fox|dog)")) is grammar   # cached
    for temperature in (0.0, 1.0):
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=temperature, grammar=grammar)
        matcher, ids = grammar.matcher(), []
        for _ in range(8):
            logits = torch.randn(1, VOCAB_SIZE, generator=gen)
            [s] = Sampler(frozenset({tok.eos_token_id}))(logits, [Row(params, gen, ids, 0, matcher)])
            assert s.error is None
            if s.token == tok.eos_token_id:
                break
            ids.append(s.token)
        assert tok.decode(ids) in ("fox", "dog")


def test_a_bad_schema_is_refused_with_the_reason():
    import pytest

    from pagedchat.engine.structured import GrammarCompiler, GrammarSpec
    from pagedchat.errors import RequestError
    from tiny_models import VOCAB_SIZE, make_tokenizer

    tok = make_tokenizer()
    with pytest.raises(RequestError, match="json_schema"):
        GrammarCompiler(tok, VOCAB_SIZE, tok.eos_token_id).compile(GrammarSpec.json_schema({"type": "nonsense"}))


def test_a_finished_grammar_wins_over_min_tokens():
    from pagedchat.engine.structured import GrammarCompiler, GrammarKind, GrammarSpec
    from tiny_models import VOCAB_SIZE, make_tokenizer

    tok = make_tokenizer()
    grammar = GrammarCompiler(tok, VOCAB_SIZE, tok.eos_token_id).compile(GrammarSpec(GrammarKind.REGEX, "fox"))
    matcher = grammar.matcher()
    ids = tok.encode("fox", add_special_tokens=False)
    assert matcher.consume_tokens(ids)
    params = SamplingParams(min_tokens=10, grammar=grammar)
    [s] = Sampler(frozenset({tok.eos_token_id}))(torch.zeros(1, VOCAB_SIZE), [Row(params, None, ids, 0, matcher)])
    assert s.token == tok.eos_token_id and s.error is None


def test_a_json_schema_keeps_its_property_order():
    from pagedchat.engine.structured import GrammarSpec

    spec = GrammarSpec.json_schema({"type": "object", "properties": {"name": {}, "country": {}}})
    assert spec.source.index('"name"') < spec.source.index('"country"')
