"""pagedchat's int4 kernel for batched rows (pagedchat/model/int4_mm.cpp): the same numbers as torch's int4 kernel
on the same packed tensors, transformers' greedy tokens through whole models, and torch's kernel wherever it
cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import pytest
import torch
from gguf_reference import transformers_from_gguf
from parity import NEAR_TIE_BF16, assert_same_greedy
from test_quant import PROMPTS, exact_blocks, tiny_quantized  # noqa: F401 (a fixture)
from tiny_models import hf_greedy

from pagedchat import Engine, SamplingParams
from pagedchat.model import int4_kernel, quant

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not quant.int4_available(), reason="this torch has no CPU int4 kernel")


@pytest.fixture(scope="module")
def kernel():
    """The kernel, built (once per machine) and loaded in this process."""
    why = int4_kernel.ensure(wait=True)
    if why is not None:
        pytest.skip(f"pagedchat's int4 kernel cannot serve here: {why}")
    return int4_kernel.op()


@pytest.fixture
def calls(kernel, monkeypatch) -> list[int]:
    """The rows of every call that pagedchat's kernel serves."""
    seen: list[int] = []
    monkeypatch.setattr(int4_kernel._state, "op", lambda x, *rest: seen.append(x.shape[0]) or kernel(x, *rest))
    return seen


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A process that has not looked for the kernel yet, with its own cache folder."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int4_kernel, "_state", int4_kernel.State())
    return tmp_path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("rows", [int4_kernel.MIN_ROWS, 13, quant.DENSE_MIN_ROWS - 1])
def test_kernel_computes_what_torchs_kernel_does(kind, rows, calls, monkeypatch):
    """The same packed weight and input: pagedchat's kernel gives torch's outputs up to the bf16 rounding of
    another summation order, and is as close to float32 arithmetic on gguf's dequantized weight."""
    n, k = 192, 512
    blocks = exact_blocks(kind, n, k)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=gen).bfloat16()
    linear = quant.Int4Linear(quant.int4_groups(blocks, kind, (n, k)), bias)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ours = linear(x)
    assert calls == [rows]
    with monkeypatch.context() as m:
        m.setattr(int4_kernel._state, "op", None)
        torchs = linear(x)
    assert calls == [rows]
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, T[kind]).reshape(n, k))
    want = x.float() @ weight.T + bias.float()
    torch_error = (torchs.float() - want).abs().max()
    assert torch_error < 0.05 * want.abs().max()  # the reference is right: only bf16 roundings apart
    assert (ours.float() - want).abs().max() <= 1.5 * torch_error
    assert (ours != torchs).float().mean() < 0.01  # a few roundings apart, not a different product


def test_few_rows_stay_on_torchs_kernel(calls):
    linear = quant.Int4Linear(quant.int4_groups(exact_blocks("Q4_1", 64, 64), "Q4_1", (64, 64)))
    linear(torch.randn(int4_kernel.MIN_ROWS - 1, 64).bfloat16())
    assert calls == []


def test_kernel_refuses_a_mismatched_input(kernel):
    linear = quant.Int4Linear(quant.int4_groups(exact_blocks("Q4_0", 64, 64), "Q4_0", (64, 64)))
    with pytest.raises(RuntimeError, match="width does not match"):
        kernel(torch.randn(8, 96).bfloat16(), linear.packed, linear.scale_zeros, False)


BATCH = [PROMPTS[i % 2][: 4 + i] for i in range(int4_kernel.MIN_ROWS + 1)]


@pytest.mark.parametrize("ours", [True, False], ids=["pagedchat-kernel", "torch-kernel"])
def test_batched_greedy_matches_transformers(tiny_quantized, ours, request, monkeypatch, tmp_path):  # noqa: F811
    """Nine chats decoding together: every projection of a step sees nine rows, on pagedchat's kernel (and on
    torch's, the fallback, wherever that one cannot be built). The tokens equal transformers' (float32, same
    GGUF) up to near-ties."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    seen: list[int] = request.getfixturevalue("calls") if ours else []
    if not ours:
        monkeypatch.setattr(int4_kernel._state, "op", None)
    kind, folder, ref = tiny_quantized
    engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="bfloat16")
    outs = engine.generate(BATCH, SamplingParams(max_tokens=10, ignore_eos=True))
    engine.shutdown()
    assert (len(BATCH) in seen) == ours
    for prompt, out in zip(BATCH, outs):
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 10), near_tie=NEAR_TIE_BF16)


@pytest.mark.slow
def test_default_model_batched_matches_transformers(default_model, calls):
    """Eight chats of the default model decoding together on pagedchat's kernel, the LM head's Q8_0 halves
    included: transformers' tokens (bf16, same GGUF) up to near-ties."""
    engine = Engine(str(default_model), kv_cache_memory="128MiB", dtype="bfloat16")
    ref = transformers_from_gguf(default_model, torch.bfloat16)
    topics = ["the moon", "bread", "rivers", "chess", "bees", "glass", "trains", "paper"]
    prompts = [engine.encode_prompt([{"role": "user", "content": f"Write one sentence about {t}."}])
               for t in topics]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    engine.shutdown()
    assert len(prompts) in calls  # the decode steps ran on it
    for prompt, out in zip(prompts, outs):
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 12, sorted(engine.eos_token_ids)),
                           near_tie=NEAR_TIE_BF16)


def test_switched_off_by_the_environment(fresh_state, monkeypatch):
    monkeypatch.setenv(int4_kernel.ENV, "0")
    assert int4_kernel.ensure(wait=True) == f"off: {int4_kernel.ENV}=0"
    assert int4_kernel.op() is None
    assert int4_kernel.describe() == f"torch's int4 kernel (off: {int4_kernel.ENV}=0)"


def test_without_a_compiler_torchs_kernel_serves(fresh_state, monkeypatch):
    if int4_kernel.unavailable() is not None:
        pytest.skip(int4_kernel.unavailable())
    monkeypatch.setenv("PATH", str(fresh_state))
    monkeypatch.delenv("CXX", raising=False)
    assert int4_kernel.ensure(wait=True) == "no C++ compiler (c++ or $CXX) on PATH"
    assert int4_kernel.op() is None


def test_a_failed_build_is_remembered(fresh_state, monkeypatch, caplog):
    """A source that does not compile: a clear reason (in the log too), the compiler's message kept, and no
    second attempt at the next start (that would cost every start the compiler's time)."""
    if int4_kernel.unavailable() is not None:
        pytest.skip(int4_kernel.unavailable())
    broken = fresh_state / "int4_mm.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(int4_kernel, "SOURCE", broken)
    why = int4_kernel.ensure(wait=True)
    marker = int4_kernel.failure_path(int4_kernel.library_path())
    assert why == f"compiling int4_mm.cpp failed (see {marker})"
    assert f"torch's serves: {why}" in caplog.text
    assert "error" in marker.read_text()
    assert not int4_kernel.library_path().exists()
    assert list((fresh_state / "kernels").iterdir()) == [marker]  # no build folder left behind

    monkeypatch.setattr(int4_kernel, "_state", int4_kernel.State())
    monkeypatch.setattr(int4_kernel, "build", lambda path: pytest.fail("built again"))
    assert int4_kernel.ensure(wait=True) == f"it did not compile here (see {marker})"


def test_a_new_machine_builds_it_in_the_background(tmp_path):
    """A process on a machine without the library goes on at once (torch's kernel serving) while a separate
    low-priority process compiles it, then switches to it: the engine's start never waits for the compiler."""
    if int4_kernel.unavailable() is not None:
        pytest.skip(int4_kernel.unavailable())
    script = """
import time
from pagedchat.model import int4_kernel
started = time.monotonic()
int4_kernel.ensure(wait=False)
print("returned after", time.monotonic() - started, int4_kernel.op() is None)
while int4_kernel.op() is None and time.monotonic() - started < 300:
    time.sleep(0.1)
print(int4_kernel.describe())
"""
    env = {**os.environ, "PAGEDCHAT_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=330)
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.strip().splitlines()
    assert first.endswith("True") and float(first.split()[2]) < 0.5
    assert last == f"pagedchat's AVX-512 int4 kernel from {int4_kernel.MIN_ROWS} rows"
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]
