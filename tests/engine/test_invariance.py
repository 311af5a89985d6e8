"""Same request, same tokens: on the default path (packed GGUF weights on pagedchat's kernels, native attention), a
reply's tokens and log-probabilities are the bits it has alone in a fresh engine, greedy and seeded, on every
level of the kernels this CPU runs, whether it runs beside others, after its prefix was cached by an earlier
request or a sibling, with its prompt cut into chunks of any size, preempted and recomputed, swapped out and back,
or forked (docs/architecture.md#same-request-same-tokens)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariance import Request, differing, drain, reply_of, run_alone, run_together, tiny_packed_model

from pagedchat import Engine, SamplingParams
from pagedchat.model import qmm

SYSTEM = list(range(40, 90))  # a shared system prompt of 50 tokens: three pages and a bit
TAILS = [[7, 8, 9], list(range(290, 311)), [11] * 9, list(range(100, 147)), [3, 1, 4, 1, 5, 9, 2, 6],
         list(range(10, 260))]  # the last: a prompt of 300 tokens, past what once took a dense path


def requests(tokens: int = 14) -> list[Request]:
    """Greedy and seeded requests on one system prompt, each asking for its log-probabilities."""
    out = []
    for i, tail in enumerate(TAILS):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0) if i % 2 else \
            SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0, temperature=0.8, seed=100 + i)
        out.append(Request(SYSTEM + tail, params))
    return out


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    return tiny_packed_model(tmp_path_factory.mktemp("tiny-q4_1"))


@pytest.fixture
def alone(tiny_q4, each_level):
    return run_alone(tiny_q4, requests(), kv_cache_memory="4MiB")


def test_batched_and_after_a_cached_prefix(tiny_q4, alone):
    """Together in one engine; then each again, its whole prompt but one token from the prefix cache; then the
    first one alone, whose system prompt its siblings then take from the cache."""
    engine = Engine(str(tiny_q4), kv_cache_memory="4MiB", autostart=False)
    assert differing(run_together(engine, requests()), alone) == []
    again = [run_together(engine, [r])[0] for r in requests()]
    assert differing(again, alone) == []
    assert engine.memory().counters.prefix_hits >= sum(len(r.prompt) - 16 for r in requests())
    engine.shutdown()
    engine = Engine(str(tiny_q4), kv_cache_memory="4MiB", autostart=False)
    first, *rest = requests()
    assert run_together(engine, [first]) == alone[:1]
    assert differing(run_together(engine, rest), alone[1:]) == []
    assert engine.memory().counters.prefix_hits >= len(rest) * 48
    engine.shutdown()


@pytest.mark.parametrize("step_tokens", [7, 16, 33, 64])
def test_chunked_prompts(tiny_q4, alone, step_tokens):
    """Prompts cut into chunks of any size, mid-page too, beside other chats' chunks and decodes."""
    engine = Engine(str(tiny_q4), kv_cache_memory="4MiB", autostart=False, max_tokens_per_step=step_tokens,
                    max_seqs=4)
    assert differing(run_together(engine, requests()), alone) == []
    engine.shutdown()


def test_steps_sized_in_time(tiny_q4, alone):
    """A step timer whose target no step meets cuts every prompt into chunks of its least tokens, where a step of
    its most would have taken them whole: the same bits."""
    steps = []
    for seconds in (None, 1e-9):
        engine = Engine(str(tiny_q4), kv_cache_memory="4MiB", autostart=False, step_seconds=seconds)
        assert differing(run_together(engine, requests()), alone) == []
        steps.append(engine.steps)
        engine.shutdown()
    assert steps[1] > steps[0]


@pytest.mark.parametrize("swap", [None, "4MiB"], ids=["recomputed", "swapped"])
def test_preempted(tiny_q4, alone, swap):
    """A pool too small for every chat at once: chats are preempted, then recomputed or swapped back in."""
    engine = Engine(str(tiny_q4), kv_cache_memory="450KiB", swap_space=swap, autostart=False)
    replies = run_together(engine, requests()[:-1])  # all but the long prompt, which alone fills the pool
    counters = engine.memory().counters
    assert (counters.swap_outs if swap else counters.recomputes) > 0
    assert differing(replies, alone[:-1]) == []
    engine.shutdown()


@pytest.fixture(scope="module")
def alone_at_best(tiny_q4):
    """The references at the CPU's best level, where the property test runs."""
    before = os.environ.get(qmm.ENV)
    qmm.use(None)
    try:
        return run_alone(tiny_q4, requests(), kv_cache_memory="4MiB")
    finally:
        qmm.use(before)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chosen=st.lists(st.integers(0, len(TAILS) - 2), min_size=1, max_size=8),
       step_tokens=st.integers(5, 200), pool_pages=st.integers(8, 60), swap=st.booleans())
def test_any_mix_of_chats_chunks_and_pool(tiny_q4, kernels, alone_at_best, chosen, step_tokens, pool_pages, swap):
    """Any chats (repeats too: a sibling's prefix in the cache), any step budget, any pool from one that preempts
    at every turn to one that holds them all: each reply is its bits alone."""
    kernels("portable")  # skips where the kernels are not built
    qmm.use(None)
    page = 3 * 2 * 2 * 64 * 4 * 16  # layers, K and V, kv heads, head_dim, float32, tokens a page
    engine = Engine(str(tiny_q4), kv_cache_memory=pool_pages * page, swap_space=4 << 20 if swap else None,
                    max_tokens_per_step=step_tokens, max_seqs=4, autostart=False)
    every = requests()
    replies = run_together(engine, [every[i] for i in chosen])
    engine.shutdown()
    assert differing(replies, [alone_at_best[i] for i in chosen]) == []


def test_forked(tiny_q4, each_level):
    """A fork of a finished reply continues as a fresh engine does on its prompt and reply so far."""
    engine = Engine(str(tiny_q4), kv_cache_memory="4MiB", autostart=False)
    request = requests(tokens=6)[1]
    parent = engine.submit(request.prompt, request.params)
    drain(engine)
    tokens = request.prompt + parent.result(timeout=0).token_ids
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, temperature=0.8, seed=7)
    child = engine.fork(parent.request_id, params)
    drain(engine)
    assert reply_of(child.result(timeout=0)) == run_alone(tiny_q4, [Request(tokens, params)],
                                                          kv_cache_memory="4MiB")[0]
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("level", [None, "avx2"], ids=["best", "avx2"])
def test_the_default_model(default_model, kernels, level):
    """SmolLM2 on chats of one system prompt: together, again after the cache holds them, chunked, preempted."""
    if level:
        kernels(level)
    engine = Engine(str(default_model), autostart=False)
    system = "You are the support assistant of a bicycle shop. Answer briefly, quote prices in euros. " * 3
    chats = [engine.encode_prompt([{"role": "system", "content": system}, {"role": "user", "content": q}])
             for q in ("How much is a new chain?", "Can you fix a flat tyre today?", "Do you sell helmets?",
                       "What does a full service include?")]
    engine.shutdown()
    reqs = [Request(chat, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0, temperature=0.8 * (i % 2),
                                         seed=i)) for i, chat in enumerate(chats)]
    alone = run_alone(default_model, reqs)
    for kwargs in ({}, {"max_tokens_per_step": 64}, {"kv_cache_memory": "12MiB"}):
        engine = Engine(str(default_model), autostart=False, **kwargs)
        assert differing(run_together(engine, reqs), alone) == [], kwargs
        if not kwargs:
            assert differing([run_together(engine, [r])[0] for r in reqs], alone) == []
        if "kv_cache_memory" in kwargs:
            assert engine.memory().counters.recomputes > 0
        engine.shutdown()
