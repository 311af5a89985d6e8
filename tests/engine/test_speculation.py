"""Speculative decoding: drafts from a chat's own text, verified in one step, rejected tokens' pages rolled back.

The fake engine (fake_engine.py) checks every K/V read after every step, so a rolled-back page handed out while
still read, a draft written into a shared page or a hash over a rejected token shows up as a wrong history; an
oracle drafter there proposes the true continuation with a wrong token planted at random, so that drafts are
kept, cut and rejected at every offset. The real engine's greedy tokens with speculation equal those without.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fake_engine import FakeEngine, isolated, toks
from pagedchat import Engine, SamplingParams
from pagedchat.engine.ngram import Speculation
from pagedchat.engine.sampling import NOT_SAMPLED, Row, Sampler
from pagedchat.engine.sequence import Sequence
from test_engine_core import OPS, Faults, run_random_operations


class OracleDrafts(Speculation):
    """Drafts the fake model's true continuation, cut short or with one token wrong, at random."""

    def __init__(self, seed: int = 0, skip: float = 0.2, plant: float = 0.6, **kw):
        super().__init__("ngram", **kw)
        self.rng = random.Random(seed)
        self.skip, self.plant = skip, plant

    def draft(self, seq, k: int) -> list[int]:
        if k <= 0 or self.rng.random() < self.skip:
            return []
        draft = isolated(seq.token_ids, self.rng.randint(1, k))
        if self.rng.random() < self.plant:
            draft[self.rng.randrange(len(draft))] = 999  # the fake model never picks 999 (next_token: 1..500)
        return draft


def test_a_kept_draft_advances_several_tokens_in_one_step():
    eng = FakeEngine(num_pages=20, cpu_pages=0, budget=16, speculation=OracleDrafts(seed=1, k=6))
    rid = eng.add(toks(9), 40)
    eng.drain()
    out = eng.ended[rid]
    assert out.token_ids == isolated(toks(9), 40)
    counters = eng.bm.counters
    assert counters.accepted > 0 and counters.drafted > counters.accepted
    assert eng.core.steps < 40, "kept drafts take fewer steps than tokens"
    assert eng.bm.pool.num_available() == eng.bm.num_pages
    assert len(eng.sched.speculation) == 0, "a finished sequence's drafting state is forgotten"


def test_rejected_drafts_pages_return_and_no_hash_covers_them():
    eng = FakeEngine(num_pages=12, cpu_pages=0, budget=16, block_size=4, speculation=Wrong("ngram", k=8))
    rid = eng.add(toks(8), 20)  # two full pages; the first draft of 8 reaches two pages past the third
    for _ in range(4):
        eng.step()
        seq = eng.core.sequence(rid)
        assert len(seq.table(0).block_table) == eng.bm.pages_for(seq.num_computed)
        assert len(seq.table(0).page_hashes) == seq.num_computed // 4
        assert eng.bm.pool.num_available() == eng.bm.num_pages - len(seq.table(0).block_table)
    counters = eng.bm.counters
    assert counters.rolled_back == 2 and counters.accepted == 0
    assert counters.drafted == 8 + 1 + 1, "after a rejection the next draft is one token"
    eng.drain()
    assert eng.ended[rid].token_ids == isolated(toks(8), 20)


class Wrong(Speculation):
    """Always a draft, always wrong: pages past the sequence's end every step, all rolled back."""

    def draft(self, seq, k):
        return [999] * k


def test_a_draft_never_takes_the_page_another_sequences_token_needs():
    # 4 + 1 pages at the two replies' ends: the whole pool, which a draft of 8 past the first would take.
    eng = FakeEngine(num_pages=5, cpu_pages=0, budget=16, block_size=4, speculation=Wrong("ngram", k=8))
    a, b = eng.add(toks(4), 10), eng.add(toks(4, 1), 2)
    eng.drain()
    counters = eng.bm.counters
    assert counters.swap_outs == counters.recomputes == 0, "a draft's pages preempted a sequence"
    assert eng.ended[a].token_ids == isolated(toks(4), 10) and eng.ended[b].token_ids == isolated(toks(4, 1), 2)


def test_a_draft_never_runs_past_max_tokens_or_the_context():
    eng = FakeEngine(num_pages=20, cpu_pages=0, budget=16, max_context=15,
                     speculation=OracleDrafts(seed=2, k=8, max_context=15))
    short, full = eng.add(toks(5), 3), eng.add(toks(9, 1), 20)
    eng.drain()
    assert eng.ended[short].token_ids == isolated(toks(5), 3)
    assert eng.ended[full].finish_reason == "context_full" and len(eng.ended[full].token_ids) == 6


def test_a_stop_token_inside_a_kept_draft_ends_the_reply_there():
    prompt = toks(6)
    want = isolated(prompt, 12)
    eng = FakeEngine(num_pages=20, cpu_pages=0, budget=16, speculation=OracleDrafts(seed=3, k=8, skip=0, plant=0))
    seq = Sequence("stop", list(prompt), len(prompt), SamplingParams(max_tokens=12, stop_token_ids=[want[4]]))
    eng.core.add(seq)
    eng.drain()
    assert eng.ended["stop"].finish_reason == "stop"
    assert eng.ended["stop"].token_ids == want[:want.index(want[4]) + 1]
    assert eng.core.steps <= 3, "the stop token came inside a kept draft"


@settings(max_examples=150 * int(os.environ.get("PAGEDCHAT_FUZZ", "1")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=8, max_size=40), num_pages=st.integers(6, 12),
       cpu_pages=st.sampled_from([0, 2, 6, 30]), budget=st.integers(3, 16), seed=st.integers(0, 2**16),
       window=st.sampled_from([None, 3, 9]))
def test_random_operations_with_speculation(ops, num_pages, cpu_pages, budget, seed, window):
    """test_engine_core's random operations (forks, preemption by swap and recompute, cancels, faults in every
    phase, a sliding-window group or not), with drafts kept, cut and rejected: after every step the pools agree
    with the block tables and every read finds its history; every reply equals the one it had alone."""
    eng = FakeEngine(num_pages=num_pages, cpu_pages=cpu_pages, budget=budget, fault_hook=Faults(), window=window,
                     window_pages=None if window is None else max(num_pages, -(-(window + budget) // 4) + 2),
                     speculation=OracleDrafts(seed, k=6))
    run_random_operations(ops, eng, cpu_pages)
    if eng.bm.counters.accepted:
        event("draft tokens kept")
    if eng.bm.counters.rolled_back:
        event("pages rolled back")


# ---- the real engine ---------------------------------------------------------------------------------------

NO_EOS = [10**9]


def copy_prompt(tokenizer) -> list[int]:
    """A passage, then the same passage again to be continued: a reply that copies it drafts well."""
    text = "def paged(blocks, size):\n    return [b * size for b in blocks if b]\n" * 3
    return tokenizer.encode(text)


def with_and_without(folder, params: SamplingParams, **engine_kwargs) -> dict[str, list[list[int]]]:
    """Each mode's tokens for three prompts (one that copies itself, one that repeats, one that does neither),
    checking that every page came back, rolled-back ones included, and that the drafts were used."""
    outs = {}
    for mode in ("off", "ngram"):
        engine = Engine(str(folder), kv_cache_memory="4MiB", speculative=mode, **engine_kwargs)
        prompts = [copy_prompt(engine.tokenizer), [5, 6, 7, 8] * 10, list(range(40, 90))]
        outs[mode] = [o.token_ids for o in engine.generate(prompts, params)]
        snap = engine.memory()
        assert snap.free_pages == snap.num_pages, "every page came back, rolled-back ones included"
        if mode == "ngram":
            assert snap.counters.accepted > 0 and snap.counters.drafted >= snap.counters.accepted
        engine.shutdown()
    outs["prompts"] = prompts
    return outs


def test_greedy_tokens_with_speculation_equal_those_without_and_transformers(tiny_llama, tiny_llama_ref,
                                                                            monkeypatch):
    from parity import assert_same_greedy
    from tiny_models import hf_greedy

    monkeypatch.setenv("PAGEDCHAT_ATTENTION", "torch")
    outs = with_and_without(tiny_llama, SamplingParams(max_tokens=80, ignore_eos=True))
    assert outs["ngram"] == outs["off"]
    for prompt, out in zip(outs["prompts"], outs["ngram"]):
        assert_same_greedy(tiny_llama_ref, prompt, out, hf_greedy(tiny_llama_ref, prompt, 80, NO_EOS))


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=80, ignore_eos=True),
                                    SamplingParams(max_tokens=80, temperature=0.05, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_on_the_default_path_a_verified_draft_gives_the_tokens_of_one_at_a_time(tmp_path, params):
    """Packed weights on pagedchat's kernels with native attention: every row's numbers are its own, whatever
    the rows beside it (docs/architecture.md#same-request-same-tokens), so verifying a draft's positions in one
    step gives exactly the tokens decoding them one a step gives."""
    from invariance import tiny_packed_model

    outs = with_and_without(tiny_packed_model(tmp_path), params)
    assert outs["ngram"] == outs["off"]


def test_a_verify_step_runs_each_layer_as_one_call_as_a_decode_does(tmp_path, monkeypatch):
    """A draft's positions go to attention as one-query rows, each at its own length: the step is a decode
    step, whose layers run as one call each (qmm.decode_layer), not op by op."""
    from invariance import tiny_packed_model
    from pagedchat.model import qmm

    rows = []
    decode_layer = qmm.decode_layer
    monkeypatch.setattr(qmm, "decode_layer", lambda x, *args: (rows.append(x.shape[0]), decode_layer(x, *args)))
    engine = Engine(str(tiny_packed_model(tmp_path)), kv_cache_memory="4MiB", dtype="float32", speculative="ngram")
    engine.generate([[5, 6, 7, 8] * 10], SamplingParams(max_tokens=40, ignore_eos=True))
    drafted = engine.memory().counters.drafted
    engine.shutdown()
    assert drafted > 0 and max(rows) > 1  # one sequence: a call of several rows verified a draft


def test_seeded_sampling_gives_the_same_tokens_with_speculation_as_without(tiny_llama, monkeypatch):
    """A sampled row keeps its draft token when it is the token drawn, and the rows after a refusal draw nothing:
    the generator's numbers, and so the tokens, are those of one token a step (where the logits are)."""
    monkeypatch.setenv("PAGEDCHAT_ATTENTION", "torch")
    prompt = [5, 6, 7, 8] * 10
    params = SamplingParams(max_tokens=40, temperature=0.05, seed=7, ignore_eos=True)  # repeats itself: drafts
    outs = {}
    for mode in ("off", "ngram"):
        engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", speculative=mode)
        outs[mode] = [engine.generate([prompt], params)[0].token_ids for _ in range(2)]
        drafted = engine.memory().counters.drafted
        engine.shutdown()
    assert outs["ngram"][0] == outs["ngram"][1] == outs["off"][0] and len(outs["off"][0]) == 40
    assert drafted > 0


def test_rows_with_logprobs_or_processors_are_not_drafted(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", speculative="ngram")
    prompt = [5, 6, 7, 8] * 10
    for params in (SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True),
                   SamplingParams(max_tokens=20, repetition_penalty=1.1, ignore_eos=True)):
        out = engine.generate([prompt], params)[0]
        assert len(out.token_ids) == 20
        assert len(out.logprobs) == (20 if params.logprobs is not None else 0)
    assert engine.memory().counters.drafted == 0
    engine.shutdown()


def test_an_unknown_speculative_setting_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="speculative must be one of auto, ngram, off"):
        Engine(str(tiny_llama), kv_cache_memory="4MiB", speculative="sometimes")


@pytest.mark.parametrize("draft", [0, 1, 3])
def test_a_sampled_rows_verification_keeps_its_distribution(draft):
    """The rejection rule for a one-token draft d: keep d with probability p(d), else sample p without d. The
    tokens come out distributed as p, whichever token was drafted."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler()
    n = 6000
    counts = torch.zeros(4)
    for _ in range(n):
        [picked] = sampler(logits, [Row(params, gen, draft=draft)])
        counts[picked.token] += 1
    want = logits[0].softmax(-1)
    assert torch.allclose(counts / n, want, atol=0.02), (counts / n, want)


def test_the_rows_after_a_refused_draft_token_draw_nothing():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0]])  # the rows all but certainly pick 1, then 2
    params = SamplingParams(temperature=1.0)
    gen, alone = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    kept = Sampler()(logits, [Row(params, gen, draft=1), Row(params, gen)])
    assert [s.token for s in kept] == [1, 2]
    refused = Sampler()(logits, [Row(params, gen, draft=0), Row(params, gen)])
    assert refused[0].token == 1 and refused[1].token == NOT_SAMPLED
    Sampler()(logits[:1], [Row(params, alone)])
    Sampler()(logits, [Row(params, alone), Row(params, alone)])
    assert torch.equal(gen.get_state(), alone.get_state()), "three draws, as one token a step would make"
