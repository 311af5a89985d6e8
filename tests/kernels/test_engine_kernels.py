"""The engine with the Triton kernels forced on (interpreted on the CPU) still matches transformers. The engines
run in processes of their own, which the conftest's float32 defaults do not reach, so they name their dtypes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slow_cases import slow_after

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from pagedchat import Engine, SamplingParams
from tiny_models import hf_greedy, load_reference, make_tiny_model
folder = make_tiny_model({folder!r}, tie=False, heads=4, kv_heads=2, head_dim=16, layers=2, **{model!r})
engine = Engine(str(folder), kv_cache_memory="2MiB", max_tokens_per_step=64, dtype="float32",
                kv_cache_dtype="float32")
assert engine.model.attention == "triton", "the Triton path was not chosen"
ref = load_reference(folder)
prompts = [engine.tokenizer.encode("paged blocks " * n)[:n] for n in (3, 17, 40)]
outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
for p, o in zip(prompts, outs):
    assert o.token_ids == hf_greedy(ref, p, 12, [10**9]), (o.token_ids, p)
print("kernels-ok")
"""


# A sliding window shorter than the longer prompts: the kernel's window skips and masks pages.
@pytest.mark.parametrize("model", slow_after([dict(arch="llama"), dict(arch="mistral", window=16)]),
                         ids=["llama", "mistral-window"])
def test_engine_with_interpreted_triton_kernels(tmp_path, model):
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDCHAT_ATTENTION="triton")
    tests = str(Path(__file__).parents[1])
    script = SCRIPT.format(tests=tests, folder=str(tmp_path / "m"), model=model)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert "kernels-ok" in done.stdout, done.stderr[-3000:]


INVARIANCE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from invariance import Request, differing, run_alone, run_together, tiny_packed_model
from pagedchat import Engine, SamplingParams
folder = tiny_packed_model(Path({folder!r}))
system = list(range(40, 90))
requests = [Request(system + tail, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0,
                                                  temperature=0.8 * (i % 2), seed=i))
            for i, tail in enumerate(([7, 8, 9], list(range(290, 311)), [3, 1, 4, 1, 5, 9, 2, 6]))]
kw = dict(kv_cache_dtype="bfloat16")
page = 3 * 2 * 2 * 64 * 2 * 16  # layers, K and V, kv heads, head_dim, bf16, tokens a page
alone = run_alone(folder, requests, kv_cache_memory="4MiB", **kw)
engine = Engine(str(folder), kv_cache_memory="4MiB", autostart=False, **kw)
assert engine.model.attention == "triton", "the Triton path was not chosen"
assert differing(run_together(engine, requests), alone) == [], "batched"
assert differing([run_together(engine, [r])[0] for r in requests], alone) == [], "after a cached prefix"
assert engine.memory().counters.prefix_hits >= 3 * 48
engine.shutdown()
# Six pages: the three chats need nine (three shared), each fits alone.
for setup in (dict(max_tokens_per_step=7), dict(kv_cache_memory=6 * page)):
    engine = Engine(str(folder), autostart=False, **dict(dict(kv_cache_memory="4MiB", **kw), **setup))
    assert differing(run_together(engine, requests), alone) == [], setup
    if "kv_cache_memory" in setup:
        assert engine.memory().counters.recomputes > 0, "the small pool preempted nothing"
    engine.shutdown()
print("invariant-ok")
"""


@pytest.mark.slow  # minutes interpreted: test_a_rows_bits_are_its_own holds the kernel's rows to their bits
def test_same_request_same_tokens_on_the_triton_path(tmp_path):
    """docs/architecture.md#same-request-same-tokens on the Triton path (interpreted): a packed model's chats, greedy
    and seeded, give the tokens and log-probabilities they get alone in a fresh engine, bit for bit, batched, after
    their prefix is cached, with prompts chunked at 7 tokens (mid-page), and preempted and recomputed. Its pages are
    bf16, the default (tests/kernels/test_kernels.py holds int8 pages' rows to the same rule)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDCHAT_ATTENTION="triton")
    tests = str(Path(__file__).parents[1])
    script = INVARIANCE_SCRIPT.format(tests=tests, folder=str(tmp_path / "m"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert "invariant-ok" in done.stdout, done.stderr[-3000:]
