"""`pagedchat bench` on a tiny random model: the command's shape, its page and weight accounting, the order of its
rounds and its ratios (with a stand-in peer), never its speed."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import platform
import pytest
import torch

from pagedchat import bench
from pagedchat.bench import options as bench_options
from pagedchat.bench import llamacpp
from pagedchat.bench.options import BenchConfig, BenchError
from pagedchat.bench.capacity import parameter_count
from pagedchat.bench.loaders import LOADERS
from pagedchat.bench.peers import Peer, Runner
from pagedchat.bench.render import header_lines, render, to_markdown
from pagedchat.model import attention, qmm
from pagedchat.bench.harness import run_bench
from pagedchat.bench.stats import percentile, timing_stats
from pagedchat.bench.workload import build_workload

MAX_TOKENS = 8
SYSTEM_TOKENS = 40
BLOCK = 16
# tiny_llama: 3 layers, 2 kv heads, head_dim 16, float32, context 512.
BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4
MAX_CONTEXT = 512
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedchat bench")
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def report(tiny_llama, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = _parse(["--model", str(tiny_llama), "--chats", "1,2", "--max-tokens", str(MAX_TOKENS),
                   "--system-tokens", str(SYSTEM_TOKENS), "--kv-cache-memory", "1MiB", "--json", str(out),
                   "--against", "transformers", "--threads", "1"])
    assert bench.run(args) == 0
    return json.loads(out.read_text())


def test_defaults_and_flags():
    args = bench.with_defaults(_parse([]))
    assert args.chats == (1, 2, 4, 8, 16) and args.max_tokens == 128 and args.system_tokens == 300
    assert bench.with_defaults(_parse(["--app"])).max_tokens == 450
    assert bench.with_defaults(_parse(["--app", "--max-tokens", "9"])).max_tokens == 9
    assert args.tabs == 1 and _parse(["--app", "--tabs", "4"]).tabs == 4
    assert args.seed == 0 and args.json_path is None and args.against == () and args.repeat == 1
    assert _parse(["--chats", "8,1,8"]).chats == (1, 8)
    assert args.threads is None and _parse(["--threads", "3"]).threads == 3
    assert _parse(["--against", "llama.cpp,transformers"]).against == ("llama.cpp", "transformers")
    assert _parse(["--against", "transformers,transformers"]).against == ("transformers",)
    for bad in (["--chats", "0,2"], ["--chats", "a"], ["--max-tokens", "0"], ["--against", "vllm"],
                ["--against", "transformers,vllm"], ["--against", ","], ["--repeat", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_shape(report):
    assert set(report) >= {"config", "machine", "model", "workload", "token_cost", "capacity", "weights", "levels",
                           "ttft_cold_warm", "cold_first_token", "startup"}
    assert [lv["chats"] for lv in report["levels"]] == [1, 2]
    assert report["machine"]["torch_threads"] == 1   # --threads
    for lv in report["levels"]:
        assert set(lv) >= {"prompt_tokens", "engine", "memory_at_peak", "sharing", "peers", "rounds"}
        assert [p["label"] for p in lv["peers"]] == ["transformers, padded batch", "transformers, one at a time"]
        for st in [lv["engine"]] + [p["stats"] for p in lv["peers"]]:
            assert st["tokens"] == lv["chats"] * MAX_TOKENS
            for key in ("end_to_end_tokens_per_s", "decode_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s",
                        "itl_p95_s"):
                assert st[key] is not None and st[key] > 0, key
        for p in lv["peers"]:
            assert p["end_to_end_ratio"] == pytest.approx(
                lv["engine"]["end_to_end_tokens_per_s"] / p["stats"]["end_to_end_tokens_per_s"])
            assert p["decode_ratio"] == pytest.approx(
                lv["engine"]["decode_tokens_per_s"] / p["stats"]["decode_tokens_per_s"])
    w = report["ttft_cold_warm"]
    assert w["cold_s"] > 0 and w["warm_s"] > 0 and w["warm_over_cold"] == pytest.approx(w["warm_s"] / w["cold_s"])
    # transformers has no cold-prompt probe: only pagedchat's own, the same figure as the cold/warm table's.
    assert [(t["runner"], t["median_s"]) for t in report["cold_first_token"]] == [("pagedchat", w["cold_s"])]


def test_startup_is_timed_in_a_fresh_process(report):
    (startup,) = report["startup"]
    assert startup["runner"] == "pagedchat" and len(startup["all_s"]) == 1
    # A fresh interpreter that imports torch and builds an Engine: more than a few milliseconds, bounded.
    assert 0.05 < startup["median_s"] < 300


def test_startup_probe_failure_is_one_line(tmp_path):
    from pagedchat.bench.startup import time_to_ready

    with pytest.raises(BenchError, match="the startup probe failed: .*no such model"):
        time_to_ready(["-c", "import sys; sys.exit('no such model')"])
    assert time_to_ready(["-c", "import time; time.sleep(0.2); print('ready', repr(time.time()))"]) >= 0.2


def test_token_cost(report):
    cost = report["token_cost"]
    assert cost["bytes_per_token_model"] == BYTES_PER_TOKEN
    assert cost["bytes_per_token_pool"] == BYTES_PER_TOKEN
    assert cost["page_bytes"] == BYTES_PER_TOKEN * BLOCK
    assert cost["num_pages"] == 2**20 // (BYTES_PER_TOKEN * BLOCK) == 85
    assert cost["max_context"] == MAX_CONTEXT


def test_page_dtypes_in_the_same_budget(report):
    """The concurrent-request ceiling by page dtype: 2,048-token chats in this run's 1 MiB, each dtype's pages cut
    from the same bytes (int8 rows: 16 codes and a 4-byte scale)."""
    rows = {row["dtype"]: row for row in report["page_dtypes"]}
    assert list(rows) == ["float32", "bfloat16", "int8"]
    pool = report["token_cost"]["pool_bytes"]
    for name, per_token in (("float32", BYTES_PER_TOKEN), ("bfloat16", BYTES_PER_TOKEN // 2),
                            ("int8", 2 * 3 * 2 * (16 + 4))):
        assert rows[name]["bytes_per_token"] == per_token
        assert rows[name]["num_pages"] == pool // (per_token * BLOCK)
        assert rows[name]["chats"] == rows[name]["num_pages"] // (2048 // BLOCK)
    assert [rows[n]["chats"] for n in rows] == [0, 1, 2]


def test_weights_beside_the_pool(report, tiny_llama):
    """The tiny model loads unpacked in float32 here: its resident bytes are its parameters x 4, so bf16 weights
    (x 2) would leave the difference to KV in a fixed budget, and 60% of it under the GPU rule."""
    from tiny_models import load_reference

    w, cost = report["weights"], report["token_cost"]
    params = sum(p.numel() for p in load_reference(tiny_llama).parameters())  # tied: the embedding counted once
    assert w["parameters"] == params
    assert w["weight_bytes"] == 4 * params and w["bf16_weight_bytes"] == 2 * params
    assert w["kv_pool_bytes"] == cost["pool_bytes"] and w["budget_bytes"] == 2 * params + cost["pool_bytes"]
    assert w["fixed_bf16"]["tokens"] == cost["pool_bytes"] // BYTES_PER_TOKEN
    assert w["fixed_loaded"]["tokens"] == (cost["pool_bytes"] - 2 * params) // BYTES_PER_TOKEN
    assert w["fixed_extra_tokens"] == w["fixed_loaded"]["tokens"] - w["fixed_bf16"]["tokens"] < 0
    assert not w["gpu_free_measured"] and w["gpu_free_bytes"] == w["budget_bytes"]
    assert w["gpu_bf16"]["kv_bytes"] == int(0.6 * cost["pool_bytes"])
    assert w["gpu_loaded"]["kv_bytes"] == int(0.6 * (cost["pool_bytes"] - 2 * params))


def test_packed_weights_leave_room(report):
    """Weights smaller than bf16 (as packed int4 ones are) leave their saving to the KV pool."""
    from pagedchat.bench.capacity import TokenCost, weight_capacity

    cost = TokenCost(**{k: v for k, v in report["token_cost"].items()})
    params = 1_000_000
    w = weight_capacity(params, params // 2, cost, ceiling_bytes=10**12, gpu_free_bytes=8 * 10**9)
    per = cost.bytes_per_token_model
    assert w.fixed_extra_tokens == (cost.pool_bytes + 2 * params - params // 2) // per - cost.pool_bytes // per
    assert w.gpu_loaded.kv_bytes == int(0.6 * (8 * 10**9 - params // 2))
    assert w.gpu_extra_tokens == w.gpu_loaded.tokens - int(0.6 * (8 * 10**9 - 2 * params)) // per > 0
    capped = weight_capacity(params, params // 2, cost, ceiling_bytes=per * 100, gpu_free_bytes=8 * 10**9)
    assert capped.gpu_loaded.tokens == capped.gpu_bf16.tokens == 100 and capped.gpu_extra_tokens == 0


def test_parameter_count_untied_and_biased(tmp_path):
    from pagedchat.model.hf_config import ModelConfig
    from tiny_models import load_reference, make_tiny_model

    for arch, tie in (("llama", False), ("qwen2", True)):
        folder = make_tiny_model(tmp_path / f"{arch}-{tie}", arch, tie=tie, layers=2)
        expected = sum(p.numel() for p in load_reference(folder).parameters())
        assert parameter_count(ModelConfig.from_folder(folder)) == expected


def test_workload(report):
    work = report["workload"]
    assert work["system_tokens"] == SYSTEM_TOKENS
    assert len(set(work["questions"])) == 2
    top = report["levels"][-1]["prompt_tokens"]
    assert top == [SYSTEM_TOKENS + u for u in work["user_tokens"]]


def test_capacity(report):
    cap, pages = report["capacity"], report["token_cost"]["num_pages"]
    longest = max(report["levels"][-1]["prompt_tokens"]) + MAX_TOKENS
    assert cap["chat_tokens"] == longest
    per_chat = math.ceil(longest / BLOCK)
    shared = SYSTEM_TOKENS // BLOCK  # 2 full pages of pure system prompt
    assert cap["paged"]["chats"] == pages // per_chat
    assert cap["paged"]["waste_slots_per_chat"] == per_chat * BLOCK - longest
    assert cap["paged_shared"]["chats"] == (pages - shared) // (per_chat - shared)
    assert cap["contiguous"]["chats"] == pages * BLOCK // MAX_CONTEXT == 2
    assert cap["contiguous"]["waste_slots_per_chat"] == MAX_CONTEXT - longest


def test_accounting_at_peak(report):
    """At the last step before the first chat finishes, it holds K/V for its prompt and MAX_TOKENS - 2 outputs
    (the newest sampled token is not computed yet), and the other no more: it waited a step for the system
    prompt's last page, which the first wrote, and shares the system prompt's full pages."""
    shared = SYSTEM_TOKENS // BLOCK
    for lv in report["levels"]:
        n = lv["chats"]
        m, s = lv["memory_at_peak"], lv["sharing"]
        assert m["chats_live"] == n
        by_id = {x["request_id"]: x["tokens"] for x in m["seqs"]}
        held = [by_id[rid] for rid in sorted(by_id, key=lambda rid: int(rid.rsplit("-", 1)[1]))]
        outputs = [h - p for h, p in zip(held, lv["prompt_tokens"])]
        assert outputs[0] == MAX_TOKENS - 2 and all(0 < k <= MAX_TOKENS - 2 for k in outputs[1:])
        own_pages = [math.ceil(h / BLOCK) for h in held]
        assert m["tokens_held"] == sum(held)
        assert s["pages_without"] == sum(own_pages)
        assert s["pages_with"] == sum(own_pages) - (n - 1) * shared
        assert s["pages_saved"] == (n - 1) * shared == m["pages_saved_by_refcount"]
        assert m["paged_slots"] == s["pages_with"] * BLOCK
        assert m["unique_tokens_held"] == sum(held) - (n - 1) * shared * BLOCK
        assert m["paged_waste_slots"] == sum(p * BLOCK - h for p, h in zip(own_pages, held))
        assert m["contiguous_slots"] == n * MAX_CONTEXT
        assert m["contiguous_waste_slots"] == n * MAX_CONTEXT - sum(held)
        assert s["prompt_tokens"] == sum(lv["prompt_tokens"])
        # Chats admitted together share the system prompt's full pages; each may also copy the start of one
        # more page from earlier requests (the chat template's first tokens), never a whole page.
        saved = s["prefill_tokens_saved"] - (n - 1) * shared * BLOCK
        assert 0 <= saved < n * BLOCK
        assert s["prefill_tokens_computed"] == s["prompt_tokens"] - s["prefill_tokens_saved"]
    # A new chat with the cached system prompt maps its full pages and copies the start of the next one
    # (the rest of the system prompt, from an earlier chat's page).
    w = report["ttft_cold_warm"]
    assert SYSTEM_TOKENS <= w["warm_cached_tokens"] < (shared + 1) * BLOCK


class _CountingProgress:
    def __init__(self):
        self.total, self.done, self.texts = None, 0, []

    def set_total(self, total):
        self.total = total

    def describe(self, text):
        self.texts.append(text)

    def advance(self, n=1):
        self.done += n


STAND_IN_STEP_S = 0.01  # the stand-in's chats all get a token every 10 ms, from 10 ms after submission


def _stand_in_llamacpp(cfg, engine, work) -> Peer:
    """A peer with llama.cpp's shape and a known speed: N chats x T tokens in T x 10 ms."""
    from pagedchat.bench.stats import timing_stats as stats

    def run(prompts, max_tokens, progress):
        progress.advance(len(prompts) * max_tokens)
        return stats(0.0, [[STAND_IN_STEP_S * (k + 1) for k in range(max_tokens)] for _ in prompts])

    return Peer("llama.cpp", (Runner("llama.cpp", "llama.cpp, shared prompt", True, run),), close=lambda: None,
                cold_first_token=lambda prompts: [0.5, 0.25, 1.0][:len(prompts)],
                startup=lambda: 0.125)


def test_rounds_alternate_over_every_peer_and_show_the_median(tiny_llama, report, monkeypatch):
    monkeypatch.setitem(LOADERS, "llama.cpp", _stand_in_llamacpp)
    progress = _CountingProgress()
    cfg = BenchConfig(model=str(tiny_llama), chats=(1, 2), max_tokens=MAX_TOKENS, system_tokens=SYSTEM_TOKENS,
                      repeat=3, against=("transformers", "llama.cpp"), kv_cache_memory="1MiB", startup=False,
                      bandwidth=False)
    rep = run_bench(cfg, progress)
    assert progress.done == progress.total  # the bar ends full
    assert [t for t in progress.texts if "2 chats" in t] == [
        f"{runner} · 2 chats · round {r} of 3" for r in (1, 2, 3)
        for runner in ("pagedchat", "transformers, padded batch", "llama.cpp, shared prompt")
    ] + ["transformers, one at a time · 2 chats"]
    stand_in_rate = MAX_TOKENS / (STAND_IN_STEP_S * MAX_TOKENS)  # per chat
    for lv, single in zip(rep.levels, report["levels"]):
        assert len(lv.rounds) == 3
        assert [[r.runner for r in rnd] for rnd in lv.rounds] == [
            ["pagedchat", "transformers_padded_batch", "llama.cpp"]] * 3
        for runner, shown in (("pagedchat", lv.engine), ("transformers_padded_batch",
                                                         lv.peer("transformers_padded_batch").stats)):
            stats = [r.stats for rnd in lv.rounds for r in rnd if r.runner == runner]
            rates = sorted(st.end_to_end_tokens_per_s for st in stats)
            assert shown.end_to_end_tokens_per_s == rates[1]
            assert all(st.tokens == lv.chats * MAX_TOKENS for st in stats)
        llama = lv.peer("llama.cpp")
        assert llama.stats.end_to_end_tokens_per_s == pytest.approx(lv.chats * stand_in_rate)
        assert llama.end_to_end_ratio == pytest.approx(lv.engine.end_to_end_tokens_per_s / (lv.chats * stand_in_rate))
        # decode: after the first token at 10 ms, the other T - 1 tokens of each chat in (T - 1) x 10 ms
        assert llama.decode_ratio == pytest.approx(lv.engine.decode_tokens_per_s / (lv.chats * stand_in_rate))
        assert [p.runner for p in lv.peers] == ["transformers_padded_batch", "llama.cpp", "transformers_one_at_a_time"]
        assert lv.sharing.pages_with == single["sharing"]["pages_with"]  # the accounting does not depend on the round
    assert [(t.runner, t.median_s) for t in rep.cold_first_token] == [
        ("pagedchat", rep.ttft_cold_warm.cold_s), ("llama.cpp", 0.5)]
    assert rep.startup == ()
    assert ("3 rounds per level of pagedchat, transformers, padded batch, llama.cpp, shared prompt"
            in "\n".join(header_lines(rep)))
    # torch's own CPU kernels (the prompts' SDPA) run at a level of their own, which ATEN_CPU_CAPABILITY lowers
    assert f"its kernels {torch.backends.cpu.get_cpu_capability()}) · " in header_lines(rep)[0]
    buf = io.StringIO()
    from rich.console import Console

    render(rep, Console(file=buf, width=220))
    text = buf.getvalue()
    assert "llama.cpp, shared prompt" in text and "decode: pagedchat is" in text and "llama.cpp, cold" in text


def test_startup_alternates_runners(tiny_llama, monkeypatch):
    from pagedchat.bench import harness

    order = []
    monkeypatch.setattr(harness, "time_to_ready", lambda args: order.append("pagedchat") or 2.0)
    peer = Peer("llama.cpp", (), close=lambda: None, startup=lambda: order.append("llama.cpp") or 0.5)
    got = harness.startup_times(BenchConfig(model=str(tiny_llama), repeat=3), 2, [peer], _CountingProgress())
    assert order == ["pagedchat", "llama.cpp"] * 3
    assert [(t.runner, t.median_s, len(t.all_s)) for t in got] == [("pagedchat", 2.0, 3), ("llama.cpp", 0.5, 3)]


def test_tables_render(tiny_llama, monkeypatch):
    from rich.console import Console

    monkeypatch.setitem(LOADERS, "llama.cpp", _stand_in_llamacpp)
    rep = run_bench(BenchConfig(model=str(tiny_llama), chats=(1,), max_tokens=MAX_TOKENS, system_tokens=SYSTEM_TOKENS,
                                against=("llama.cpp",), kv_cache_memory="1MiB", startup=False))
    buf = io.StringIO()
    render(rep, Console(file=buf, width=200))
    text = buf.getvalue()
    for title in ("What one token costs", "Capacity", "Weights beside the KV pool", "Waste measured", "Sharing",
                  "Speed", "First token", "llama.cpp, shared prompt", "GPU rule", "Page dtypes (--kv-cache-dtype)",
                  "float32 (this run)", "int8"):
        assert title in text
    assert f"{BYTES_PER_TOKEN:,}" in text
    md = to_markdown(rep)
    assert "**1. What one token costs**" in md and "| chats | runner |" in md and md.count("|---:|") >= 1
    assert rep.machine.read_bandwidth > 0 and "memory read bandwidth " in text
    assert rep.machine.read_bandwidth_torch is None or rep.machine.read_bandwidth_torch > 0
    around = [res.read_bandwidth for rnd in rep.levels[0].rounds for res in rnd]
    assert len(around) == 2 and all(len(pair) == 2 and min(pair) > 0 for pair in around)
    assert around[0][1] == around[1][0], "one measure between two runners' rounds: after the one, before the next"
    assert "GiB/s around the one-chat rounds" in md


def test_the_header_gives_each_runners_share_of_the_bandwidth_around_its_one_chat_rounds(tiny_llama, monkeypatch):
    import dataclasses

    monkeypatch.setitem(LOADERS, "llama.cpp", _stand_in_llamacpp)
    rep = run_bench(BenchConfig(model=str(tiny_llama), chats=(1, 2), max_tokens=MAX_TOKENS,
                                system_tokens=SYSTEM_TOKENS, against=("llama.cpp",), kv_cache_memory="1MiB",
                                startup=False, bandwidth=False, repeat=2))
    assert rep.machine.read_bandwidth is None and rep.machine.read_bandwidth_torch is None  # not measured
    assert rep.bandwidth_shares() == [] and rep.round_bandwidths() == []
    # Each round its own bandwidth: 10 MiB/s around the first (8 before, 12 after), 20 around the second.
    mib = 2**20
    around = [(8 * mib, 12 * mib), (16 * mib, 24 * mib)]
    one = rep.levels[0]
    rounds = tuple(tuple(dataclasses.replace(res, read_bandwidth=bw) for res in rnd)
                   for rnd, bw in zip(one.rounds, around))
    rep = dataclasses.replace(rep, levels=(dataclasses.replace(one, rounds=rounds), *rep.levels[1:]),
                              machine=dataclasses.replace(rep.machine, read_bandwidth=40 * mib,
                                                          read_bandwidth_torch=30 * mib))
    weights = rep.weights.weight_bytes
    ours = [rnd[0].stats.decode_tokens_per_s * weights / (bw * mib) for rnd, bw in zip(rounds, (10, 20))]
    theirs = [weights * 100 / (bw * mib) for bw in (10, 20)]  # the stand-in decodes 100 tok/s
    assert rep.bandwidth_shares() == [("pagedchat", pytest.approx(sum(ours) / 2)),
                                      ("llama.cpp, shared prompt", pytest.approx(sum(theirs) / 2))]
    line = next(line for line in header_lines(rep) if line.startswith("memory read bandwidth"))
    assert line.startswith("memory read bandwidth 0.0 GiB/s at the start (in huge pages, as pagedchat's weights "
                           "are; 0.0 in torch's own memory; a 1 GiB torch.sum on every core, best of 5); "
                           "0.0-0.0 GiB/s around the one-chat rounds; one chat's decode reads the weights (")
    assert line.endswith(f"a token) at {50 * sum(ours):.0f}% (pagedchat), {50 * sum(theirs):.0f}% (llama.cpp, "
                         "shared prompt) of the bandwidth measured just before and after each of its rounds (median)")
    assert rep.round_bandwidths() == [8 * mib, 12 * mib] * 2 + [16 * mib, 24 * mib] * 2
    without = dataclasses.replace(rep, machine=dataclasses.replace(rep.machine, read_bandwidth=None))
    assert not any(line.startswith("memory read bandwidth") for line in header_lines(without))


def test_llamacpp_missing_is_one_line(tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: None)
    args = _parse(["--model", str(tiny_llama), "--chats", "1", "--max-tokens", str(MAX_TOKENS),
                   "--system-tokens", str(SYSTEM_TOKENS), "--kv-cache-memory", "1MiB", "--against", "llama.cpp"])
    assert bench.run(args) == 2
    err = capsys.readouterr().err
    assert "needs llama-cpp-python: pip install 'pagedchat[llamacpp]'" in err and len(err.strip().splitlines()) == 1


def test_gguf_file_found(tmp_path, monkeypatch):
    from pagedchat.model import pull

    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert llamacpp.gguf_file(str(gguf), tmp_path) == gguf
    assert llamacpp.gguf_file(str(tmp_path), tmp_path) == gguf  # a folder holding one
    with pytest.raises(BenchError, match="pass --model FILE.gguf"):
        llamacpp.gguf_file(str(tmp_path / "missing"), tmp_path)
    # The default model: its folder's GGUF when it keeps one, else the one pull fetches.
    default = tmp_path / "default"
    default.mkdir()
    monkeypatch.setattr(pull, "default_model_dir", lambda: default)
    monkeypatch.setattr(pull, "fetch_default_gguf", lambda dest: dest / "fetched.gguf")
    assert llamacpp.gguf_file(None, tmp_path / "keep") == tmp_path / "keep" / "fetched.gguf"
    (default / "kept.gguf").write_bytes(b"GGUF")
    assert llamacpp.gguf_file(None, tmp_path / "keep") == default / "kept.gguf"


@pytest.mark.slow  # loads and runs llama.cpp itself: the other llamacpp tests stand in for it in the fast run
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (CI never builds it)")
def test_llamacpp_runs_the_same_tokens_for_real(tiny_llama, tmp_path):
    """On a tiny GGUF: every chat gets exactly max_tokens tokens, the shared prefix decoded once."""
    from tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf")  # two tensors in Q8_0: packed, the rest F32
    cfg = BenchConfig(model=str(gguf), chats=(1, 3), max_tokens=MAX_TOKENS, system_tokens=SYSTEM_TOKENS,
                      against=("llama.cpp",), kv_cache_memory="1MiB", repeat=1)
    rep = run_bench(cfg)
    for lv in rep.levels:
        llama = lv.peer("llama.cpp")
        assert llama.stats.tokens == lv.chats * MAX_TOKENS and llama.end_to_end_ratio > 0
    cold = rep.cold_first_token[1]
    assert cold.runner == "llama.cpp" and len(cold.all_s) == 3 and cold.median_s > 0
    assert [t.runner for t in rep.startup] == ["pagedchat", "llama.cpp"] and rep.startup[1].median_s > 0
    # the header says which level each side runs at: this CPU's, pagedchat's kernels', llama.cpp's build
    header = "\n".join(header_lines(rep))
    assert f"this CPU's best level: {qmm.best_label()}" in header
    assert f"Q8_0 panels on {qmm.describe()}" in header and "Q8_0 packed" in header
    assert f"attention: {attention.describe('native')}" in header
    assert "llama.cpp: built for " in header and ("AVX2" in header or platform.machine() != "x86_64")


def test_budget_too_small(tiny_llama, capsys):
    # 40 kB holds 3 pages: not enough for two chats of ~120 tokens.
    args = _parse(["--model", str(tiny_llama), "--chats", "2", "--max-tokens", str(MAX_TOKENS),
                   "--system-tokens", str(SYSTEM_TOKENS), "--kv-cache-memory", "40kB"])
    assert bench.run(args) == 2
    err = capsys.readouterr().err
    assert "the KV budget holds 3 pages" in err and "--kv-cache-memory" in err
    assert len(err.strip().splitlines()) == 1


def test_system_prompt_too_short(tiny_llama, capsys):
    args = _parse(["--model", str(tiny_llama), "--chats", "1", "--system-tokens", "2"])
    assert bench.run(args) == 2
    assert "--system-tokens 2 is too short" in capsys.readouterr().err


def test_workload_exact_lengths():
    from tiny_models import make_tokenizer

    tok = make_tokenizer()
    for s in (20, 40, 300, 1000):  # 1000 needs the policy repeated
        work = build_workload(tok, s, 30, seed=3)
        assert len(work.system_ids) == s
        assert all(p[:s] == work.system_ids for p in work.prompts)
        assert len(set(work.questions)) == 30  # more chats than stock questions: still distinct
        cold = work.cold_prefix(5)
        assert len(cold) == s and cold[:BLOCK] != work.system_ids[:BLOCK]
        assert cold[:BLOCK] != work.cold_prefix(6)[:BLOCK]
    assert build_workload(tok, 40, 4, seed=1).questions == build_workload(tok, 40, 4, seed=1).questions


def test_stats():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    st = timing_stats(0.0, [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]])
    assert st.tokens == 6 and st.end_to_end_tokens_per_s == pytest.approx(6 / 3.5)
    assert st.ttft_p50_s == pytest.approx(1.25)
    assert st.itl_p50_s == pytest.approx(1.0)
    # decode: from 1.5 s (both chats started) to 3.5 s, the 4 tokens after 1.5 s
    assert st.decode_tokens_per_s == pytest.approx(4 / 2.0)


def test_peer_names_match_the_loaders():
    assert set(bench_options.PEERS) == set(LOADERS)


def test_the_header_names_torchs_int4_path(tiny_llama, tmp_path, monkeypatch, kernels):
    """A GGUF in bf16 where pagedchat's kernels are off: its Q8_0 tensors run as int4 groups on torch's kernel,
    and the header says so (the blocks' kernels serve nothing then, so they are not named)."""
    from tiny_gguf import write_tiny_gguf

    from pagedchat.model import quant

    if not quant.int4_available():
        pytest.skip("this torch has no CPU int4 kernel")
    kernels("off")
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf")
    cfg = BenchConfig(model=str(gguf), chats=(1,), max_tokens=MAX_TOKENS, system_tokens=SYSTEM_TOKENS,
                      kv_cache_memory="1MiB", dtype="bfloat16", startup=False, bandwidth=False)
    header = "\n".join(header_lines(run_bench(cfg)))
    assert "Q8_0 as 2×int4" in header and "int4 groups on torch's int4 kernel" in header
    assert "kernels (int8 dot products" not in header
