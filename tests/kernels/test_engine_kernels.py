"""The engine with the Triton kernels forced on (interpreted on the CPU) still matches transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from pagedchat import Engine, SamplingParams
from tiny_models import hf_greedy, load_reference, make_tiny_model
folder = make_tiny_model({folder!r}, tie=False, heads=4, kv_heads=2, head_dim=16, layers=2, **{model!r})
engine = Engine(str(folder), kv_cache_memory="2MiB", max_tokens_per_step=64)
assert engine.model.attention == "triton", "the Triton path was not chosen"
ref = load_reference(folder)
prompts = [engine.tokenizer.encode("paged blocks " * n)[:n] for n in (3, 17, 40)]
outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
for p, o in zip(prompts, outs):
    assert o.token_ids == hf_greedy(ref, p, 12, [10**9]), (o.token_ids, p)
print("kernels-ok")
"""


# A sliding window shorter than the longer prompts: the kernel's window skips and masks pages.
@pytest.mark.parametrize("model", [dict(arch="llama"), dict(arch="mistral", window=16)],
                         ids=["llama", "mistral-window"])
def test_engine_with_interpreted_triton_kernels(tmp_path, model):
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDCHAT_ATTENTION="triton")
    tests = str(Path(__file__).parents[1])
    script = SCRIPT.format(tests=tests, folder=str(tmp_path / "m"), model=model)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert "kernels-ok" in done.stdout, done.stderr[-3000:]
