"""The engine's core promise: greedy tokens equal transformers', however requests are batched."""

import json
import math

import pytest
import torch

from pagedchat import Engine, SamplingParams
from pagedchat.errors import ModelError, RequestError
from parity import NEAR_TIE, NEAR_TIE_BF16, NEAR_TIE_PACKED, assert_same_greedy
from slow_cases import slow_after
from tiny_models import hf_greedy, load_reference, make_tiny_model

NO_EOS = [10**9]  # an id that never occurs, so transformers runs to max_new_tokens like ignore_eos


def prompt_of(tokenizer, n: int, salt: int = 0) -> list[int]:
    """n token ids from real text, different per salt."""
    text = " ".join(f"fox {salt} jumps over dog {i}, paged blocks hold keys." for i in range(n))
    return tokenizer.encode(text)[:n]


MODELS = {  # the fast run keeps the first two: one of each architecture (tests/model/test_families.py has all)
    "llama-tied-gqa": dict(arch="llama", tie=True, heads=4, kv_heads=2),
    "qwen2-tied-mqa": dict(arch="qwen2", tie=True, heads=4, kv_heads=1),
    "llama-untied-mha": dict(arch="llama", tie=False, heads=4, kv_heads=4),
    "llama-gqa4": dict(arch="llama", tie=True, heads=8, kv_heads=2, head_dim=8),
    "llama3-rope-scaling": dict(arch="llama", tie=True, rope_scaling={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-untied": dict(arch="qwen2", tie=False, heads=4, kv_heads=2),
}


@pytest.mark.parametrize("name", slow_after(list(MODELS), keep=2))
def test_greedy_matches_transformers(tmp_path, name):
    folder = make_tiny_model(tmp_path, layers=3, **MODELS[name])
    ref = load_reference(folder)
    engine = Engine(str(folder), kv_cache_memory="4MiB")
    prompts = [prompt_of(engine.tokenizer, n, salt=n) for n in (1, 15, 16, 17, 40, 90)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=37, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 37 and out.finish_reason == "length"
        assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 37, NO_EOS))
    engine.shutdown()


def test_chat_prompt_and_eos_match_transformers(tiny_llama, tiny_llama_ref):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    chat = [{"role": "user", "content": "hello fox, tell me about paged blocks"}]
    ids = engine.encode_prompt(chat)
    text = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ids == engine.tokenizer.encode(text, add_special_tokens=False)
    [out] = engine.generate([chat], SamplingParams(max_tokens=60))
    expected = hf_greedy(tiny_llama_ref, ids, 60, sorted(engine.eos_token_ids))
    assert_same_greedy(tiny_llama_ref, ids, out.token_ids, expected)
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_batched_equals_alone(tiny_llama):
    """Eight prompts of different lengths together give the same tokens as each run alone."""
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", max_tokens_per_step=96)
    prompts = [prompt_of(engine.tokenizer, n, salt=i) for i, n in enumerate((3, 16, 17, 31, 48, 64, 90, 120))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert engine.memory().free_pages == engine.memory().num_pages


def test_pages_follow_tokens_and_all_return(tiny_llama):
    """While running, n computed tokens hold ceil(n/16) pages; finished or cancelled, every page is free."""
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", autostart=False)  # driven by hand
    handles = engine.submit_many([prompt_of(engine.tokenizer, n, salt=n) for n in (5, 16, 33)],
                                 SamplingParams(max_tokens=40, ignore_eos=True))
    doomed = engine.submit(prompt_of(engine.tokenizer, 20), SamplingParams(max_tokens=100, ignore_eos=True))
    steps = 0
    while engine.scheduler.has_work() or steps == 0:
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:
            assert len(seq.table(0).block_table) == math.ceil(seq.num_computed / 16)
        if steps == 10:
            engine.cancel(doomed.request_id)
    snap = engine.memory()
    assert snap.free_pages == snap.num_pages and not snap.seqs and not snap.ref_counts
    assert doomed.result(timeout=0).finish_reason == "cancelled"
    assert all(len(h.result(timeout=0).token_ids) == 40 for h in handles)


def test_memory_snapshot_lists_live_pages(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", autostart=False)
    handle = engine.submit(prompt_of(engine.tokenizer, 40), SamplingParams(max_tokens=5))
    engine.step()
    snap = engine.memory()
    pages = snap.seqs[handle.request_id].pages
    assert len(pages) == 3 and all(snap.ref_counts[p] == 1 for p in pages)
    assert snap.free_pages == snap.num_pages - 3 and snap.block_size == 16


def test_memory_snapshot_survives_json(tiny_llama):
    """What `pagedchat serve` sends at /v1/memory reads back as the same snapshot, page keys included."""
    from pagedchat.engine.kv_snapshot import MemorySnapshot

    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    parent = engine.submit(prompt_of(engine.tokenizer, 40), SamplingParams(max_tokens=30, ignore_eos=True))
    next(iter(parent))
    child = engine.fork(parent.request_id, SamplingParams(max_tokens=30, ignore_eos=True))
    seen = []
    child.on_update = lambda _: seen.append(engine.memory()) if not seen else None
    child.result()
    snap = seen[0]
    assert snap.ref_counts and snap.seqs
    assert MemorySnapshot.from_json(json.loads(json.dumps(snap.to_json()))) == snap
    engine.shutdown()


def test_stop_strings_max_tokens_and_streaming(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    prompt = prompt_of(engine.tokenizer, 12)
    [free] = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free.text[5:8]
    assert stop, "the tiny model should produce some text"
    handle = engine.submit(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))
    streamed = "".join(delta.text for delta in handle)
    done = handle.result(timeout=30)
    assert done.finish_reason == "stop" and stop not in done.text
    assert streamed == done.text and free.text.startswith(done.text)
    # The first request's first page starts with the same 12 tokens: 11 are copied, the last is computed.
    assert done.time_to_first_token is not None and (done.cached_tokens, done.prefilled_tokens) == (11, 1)


def test_sampling_is_seeded(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    prompt = prompt_of(engine.tokenizer, 10)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], params)
    assert a.token_ids == b.token_ids
    [c] = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True))
    [g] = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    assert c.token_ids != a.token_ids or c.token_ids != g.token_ids


def test_bad_inputs_leave_the_engine_usable(tiny_llama, tmp_path):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    with pytest.raises(RequestError, match="context"):
        engine.generate([[5] * 600], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        engine.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="KV cache holds"):
        Engine(str(tiny_llama), kv_cache_memory=12288 * 2).generate([[5] * 40], SamplingParams(max_tokens=4))
    [ok] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok.token_ids) == 4


def test_bad_model_folders(tmp_path, tiny_llama):
    with pytest.raises(ModelError, match="no such model"):
        Engine(str(tmp_path / "nowhere"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        Engine(str(gpt2))
    broken = make_tiny_model(tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match="model.safetensors"):
        Engine(str(broken))


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_dtype_names(tiny_llama, kv):
    """bf16 activations over pages of any dtype: the pages' dtype is the pool's own."""
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", dtype="bfloat16", kv_cache_dtype=kv)
    assert engine.dtype == torch.bfloat16 and engine.runner.kv_cache.dtype == getattr(torch, kv)
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="unknown dtype"):
        Engine(str(tiny_llama), dtype="float8")


def test_default_dtype_follows_the_cpu(tmp_path, monkeypatch, _float32_by_default):
    from pagedchat.engine import sizing

    has_bf16 = _float32_by_default  # the real flag reader, which conftest swaps out for every other test
    with_bf16, without = tmp_path / "bf16", tmp_path / "plain"
    with_bf16.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    without.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16x\n")
    assert has_bf16(str(with_bf16)) and not has_bf16(str(without)) and not has_bf16(str(tmp_path / "missing"))
    cpu = torch.device("cpu")
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda native=native: native)
        assert sizing.parse_dtype(None, cpu) == sizing.parse_dtype("auto", cpu) == want
    assert sizing.parse_dtype("float32", cpu) == torch.float32  # a named dtype is never second-guessed


def test_torch_runs_on_the_engine_thread_only(tiny_llama, monkeypatch):
    """Loading and every step run on the engine's one compute thread, none on the caller's (see
    pagedchat/engine/compute_thread.py for why a second OpenMP team costs 1.5x per step)."""
    import threading

    from pagedchat.engine import engine as engine_module
    from pagedchat.engine.model_runner import ModelRunner

    seen = []
    load, execute = engine_module.load_weights, ModelRunner.execute
    monkeypatch.setattr(engine_module, "load_weights", lambda *a: seen.append(threading.current_thread()) or load(*a))
    monkeypatch.setattr(ModelRunner, "execute",
                        lambda self, plan: seen.append(threading.current_thread()) or execute(self, plan))
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", threads=1)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(seen) >= 4 and {t.name for t in seen} == {"pagedchat-engine"} and len(set(seen)) == 1
    worker = seen[0]
    engine.shutdown()
    assert not worker.is_alive()
    with pytest.raises(RequestError, match="shut down"):
        engine.submit([5, 6, 7])


DEFAULT_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Describe the sea."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]


# The paths a CPU takes: torch's with the weights dequantized (float32: transformers' tokens bit for bit),
# pagedchat's kernels on float32 activations (a CPU without native bf16) at its best level and at AVX2, and on
# bf16 ones (the default where the hardware has bf16); and the pages' dtypes (the last: float32 where transformers'
# tokens come bit for bit, bf16 pages what auto holds). Near-ties may flip, then the continuations part and the
# comparison stops.
DEFAULT_MODEL_PATHS = {"float32-exact": ("float32", "off", NEAR_TIE, "float32"),
                       "float32-packed": ("float32", None, NEAR_TIE_PACKED, "float32"),
                       "float32-packed-avx2": ("float32", "avx2", NEAR_TIE_PACKED, "float32"),
                       "bfloat16-packed": ("bfloat16", None, NEAR_TIE_BF16, "float32"),
                       "float32-packed-bf16-pages": ("float32", None, NEAR_TIE_PACKED, "bfloat16"),
                       "float32-packed-int8-pages": ("float32", None, NEAR_TIE_PACKED, "int8")}
paths_of_the_default_model = pytest.mark.parametrize("dtype,level,near_tie,kv", DEFAULT_MODEL_PATHS.values(),
                                                     ids=DEFAULT_MODEL_PATHS.keys())


@pytest.mark.slow
@paths_of_the_default_model
def test_default_model_matches_transformers(default_model, kernels, dtype, level, near_tie, kv):
    """SmolLM2-135M-Instruct, the app's default model, on real chat prompts, batched together."""
    from gguf_reference import shared_greedy, shared_reference

    if level:
        kernels(level)
    max_tokens = 40 if dtype == "float32" else 24
    engine = Engine(str(default_model), kv_cache_memory="128MiB", dtype=dtype, kv_cache_dtype=kv)
    ref = shared_reference(default_model, getattr(torch, dtype))  # the model transformers makes of the GGUF
    prompts = [engine.encode_prompt(chat) for chat in DEFAULT_CHATS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        expected = shared_greedy(default_model, getattr(torch, dtype), prompt, max_tokens, sorted(engine.eos_token_ids))
        assert_same_greedy(ref, prompt, out.token_ids, expected, near_tie=near_tie)
    if level == "off":  # elsewhere the first token is a near-tie ("The" 25.33, "L'" 25.24 in float32) it may flip
        assert "Paris" in outs[0].text


@pytest.mark.slow
@paths_of_the_default_model
def test_default_model_chats_on_one_system_prompt_match_transformers(default_model, monkeypatch, shared_prefix_reads,
                                                                     kernels, dtype, level, near_tie, kv):
    """Chats that share a system prompt decode with its pages read once for all of them (the threshold is
    lowered so that three chats qualify); their tokens still equal transformers'."""
    from gguf_reference import shared_greedy, shared_reference

    from pagedchat.model import attention

    if level:
        kernels(level)
    monkeypatch.setattr(attention, "SHARED_PREFIX_MIN_SAVED_KEYS", 0)
    engine = Engine(str(default_model), kv_cache_memory="128MiB", dtype=dtype, kv_cache_dtype=kv)
    ref = shared_reference(default_model, getattr(torch, dtype))  # the model transformers makes of the GGUF
    system = ("You are the support assistant of a bicycle shop. Answer briefly and politely, quote prices in "
              "euros, and never promise delivery dates. Repairs take two to five working days. ") * 2
    questions = ["How much is a new chain?", "Can you fix a flat tyre today?", "Do you sell helmets?"]
    prompts = [engine.encode_prompt([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    engine.shutdown()
    assert shared_prefix_reads
    for prompt, out in zip(prompts, outs):
        expected = shared_greedy(default_model, getattr(torch, dtype), prompt, 16, sorted(engine.eos_token_ids))
        assert_same_greedy(ref, prompt, out.token_ids, expected, near_tie=near_tie)


def test_interpreter_exits_with_engines_left_running(tiny_llama):
    """Engines never shut down (their loops alive) must not hold up interpreter exit: no join at exit."""
    import subprocess
    import sys
    import time

    script = (
        "import sys\n"
        "from pagedchat import Engine, SamplingParams\n"
        "engines = [Engine(sys.argv[1], kv_cache_memory='4MiB') for _ in range(2)]\n"
        "for e in engines: e.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))\n"
        "print('exiting', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "exiting"
    start = time.monotonic()
    assert proc.wait(timeout=120) == 0
    assert time.monotonic() - start < 8, "exit waited on an engine thread (a close() join takes 10 s)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [32, 64, 576, 896, 2048])
def test_norm_and_rotary_equal_transformers_bit_for_bit(dtype, hidden):
    """The two rewritten formulas (fused RMSNorm, sign-folded rotary) give transformers' exact bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from pagedchat.model.decoder import apply_rope, rms_norm

    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
    ref = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    ref.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))

    head_dim, heads = 64, hidden // 32
    qk = torch.randn(37, heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(37, head_dim // 2, generator=gen) * 100
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    folded = sin.clone()
    folded[:, : head_dim // 2].neg_()
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
    want, _ = apply_rotary_pos_emb(qk.transpose(0, 1)[None], qk.transpose(0, 1)[None], cos[None], sin[None])
    got = apply_rope(qk, cos[:, None], folded[:, None])
    assert torch.equal(got, want[0].transpose(0, 1))


def test_packed_weights_give_f_linear_bits():
    """bf16 projections on the CPU use oneDNN-packed weights only where they equal F.linear bit for bit."""
    import torch.nn.functional as F

    from pagedchat.model.linear import Linear, packing_is_exact

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    assert not packing_is_exact(weight.float())  # fp32 keeps F.linear: MKL's kernel, as transformers uses
    if not packing_is_exact(weight):
        pytest.skip("this torch build has no exact oneDNN packing: plain weights are used")
    for b in (None, bias):
        packed = Linear(weight, b, packed=True)
        assert packed.weight is None  # the plain copy is dropped, so packing costs no memory
        # The packed tensor is opaque (no storage): its bytes are its bf16 elements, plus the bias.
        assert packed.nbytes == weight.numel() * 2 + (0 if b is None else b.numel() * 2)
        for rows in (1, 2, 8, 16, 45, 300):
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            assert torch.equal(packed(x), F.linear(x, weight, b))


@pytest.mark.parametrize("tie", [True, False])
def test_weight_bytes_count_every_tensor_once(tmp_path, tie):
    """float32 weights held plain take exactly the checkpoint's bytes, a tied head counted once."""
    from safetensors import safe_open

    folder = make_tiny_model(tmp_path, "llama", tie=tie)
    with safe_open(folder / "model.safetensors", "pt") as f:
        expected = sum(f.get_tensor(k).nbytes for k in f.keys())
    engine = Engine(str(folder), kv_cache_memory="4MiB", dtype="float32")
    assert engine.model.weight_bytes() == expected
    engine.shutdown()


def test_stepping_by_hand_runs_on_the_engines_compute_thread(tmp_path):
    """A caller stepping the engine from its own thread must not start a second OpenMP team (it doubled every
    step, engine/compute_thread.py): the step, and so its callbacks, run on the engine's thread."""
    import threading

    engine = Engine(str(make_tiny_model(tmp_path / "m")), kv_cache_memory="4MiB", dtype="float32", autostart=False)
    threads = set()
    engine.submit([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True),
                  on_update=lambda update: threads.add(threading.current_thread().name))
    while engine.has_work():
        engine.step()
    assert threads == {"pagedchat-engine"}
    engine.shutdown()
    assert engine.step() == [], "a stopped engine steps nothing, and does not wait for its gone thread"
