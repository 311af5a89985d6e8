"""The sampler alone: greedy rows, temperature, top-k and top-p, and seeded generators."""

from __future__ import annotations

import math
from collections import Counter

import torch

from pagedchat.engine.params import SamplingParams
from pagedchat.engine.sampling import Sampler

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def draws(params: SamplingParams, n: int, seed: int = 0, logits: torch.Tensor = LOGITS) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [Sampler()(logits[None], [params], [gen])[0] for _ in range(n)]


def test_greedy_rows_take_the_argmax_and_need_no_generator():
    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0])])
    assert Sampler()(logits, [SamplingParams()] * 3, [None] * 3) == [1, 3, 2]


def test_low_precision_logits_are_sampled_in_float32():
    assert Sampler()(LOGITS[None].to(torch.bfloat16), [SamplingParams()], [None]) == [1]


def test_rows_mix_greedy_and_sampled():
    hot = SamplingParams(temperature=1.0, top_k=1)
    assert Sampler()(torch.stack([LOGITS, LOGITS]), [SamplingParams(), hot],
                     [None, torch.Generator().manual_seed(1)]) == [1, 1]


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


def test_a_row_whose_sampling_raises_gets_its_exception_and_the_others_their_tokens():
    def second_row_breaks(row: int) -> None:
        if row == 1:
            raise RuntimeError("row 1 broke")

    hot = SamplingParams(temperature=1.0, top_k=1)
    rows = Sampler()(torch.stack([LOGITS, LOGITS, LOGITS]), [SamplingParams(), hot, hot],
                     [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)],
                     after_row=second_row_breaks)
    assert rows[0] == 1 and rows[2] == 1
    assert isinstance(rows[1], RuntimeError) and str(rows[1]) == "row 1 broke"
