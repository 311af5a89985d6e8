"""`pagedchat bench` on a tiny random model: the command's shape and its page accounting, never its speed."""

from __future__ import annotations

import argparse
import io
import json
import math

import pytest

from pagedchat import bench

MAX_TOKENS = 8
SYSTEM_TOKENS = 40
BLOCK = 16
# tiny_llama: 3 layers, 2 kv heads, head_dim 16, float32, context 512.
BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4
MAX_CONTEXT = 512


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedchat bench")
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def report(tiny_llama, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    args = _parse(["--model", str(tiny_llama), "--chats", "1,2", "--max-tokens", str(MAX_TOKENS),
                   "--system-tokens", str(SYSTEM_TOKENS), "--kv-cache-memory", "1MiB", "--json", str(out),
                   "--against", "transformers"])
    assert bench.run(args) == 0
    return json.loads(out.read_text())


def test_defaults_and_flags():
    args = _parse([])
    assert args.chats == [1, 2, 4, 8, 16] and args.max_tokens == 128 and args.system_tokens == 300
    assert args.seed == 0 and args.json_path is None and args.against is None and args.repeat == 1
    assert _parse(["--chats", "8,1,8"]).chats == [1, 8]
    for bad in (["--chats", "0,2"], ["--chats", "a"], ["--max-tokens", "0"], ["--against", "vllm"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_shape(report):
    assert set(report) >= {"command", "machine", "model", "workload", "token_cost", "capacity", "levels",
                           "ttft_cold_warm"}
    assert [lv["chats"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert set(lv) >= {"prompt_tokens", "engine", "memory_at_peak", "sharing", "transformers", "ratios"}
        runs = [lv["engine"], lv["transformers"]["one_at_a_time"], lv["transformers"]["padded_batch"]]
        for st in runs:
            assert st["tokens"] == lv["chats"] * MAX_TOKENS
            for key in ("end_to_end_tokens_per_s", "decode_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s",
                        "itl_p95_s"):
                assert st[key] is not None and st[key] > 0, key
        assert lv["ratios"]["vs_one_at_a_time"] > 0 and lv["ratios"]["vs_padded_batch"] > 0
    w = report["ttft_cold_warm"]
    assert w["cold_s"] > 0 and w["warm_s"] > 0 and w["warm_over_cold"] == pytest.approx(w["warm_s"] / w["cold_s"])


def test_token_cost(report):
    cost = report["token_cost"]
    assert cost["bytes_per_token_model"] == BYTES_PER_TOKEN
    assert cost["bytes_per_token_pool"] == BYTES_PER_TOKEN
    assert cost["page_bytes"] == BYTES_PER_TOKEN * BLOCK
    assert cost["num_pages"] == 2**20 // (BYTES_PER_TOKEN * BLOCK) == 85
    assert cost["max_context"] == MAX_CONTEXT


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
    """At the last step before the chats finish, chat i holds K/V for its prompt and MAX_TOKENS - 2 outputs
    (the newest sampled token is not computed yet); the two admitted together share the system prompt's full
    pages."""
    shared = SYSTEM_TOKENS // BLOCK
    for lv in report["levels"]:
        n = lv["chats"]
        held = [p + MAX_TOKENS - 2 for p in lv["prompt_tokens"]]
        own_pages = [math.ceil(h / BLOCK) for h in held]
        m, s = lv["memory_at_peak"], lv["sharing"]
        assert m["chats_live"] == n
        assert sorted(x["tokens"] for x in m["seqs"]) == sorted(held)
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


def test_tables_render(report):
    from rich.console import Console

    buf = io.StringIO()
    bench.render(report, Console(file=buf, width=160))
    text = buf.getvalue()
    for title in ("What one token costs", "Capacity", "Waste measured", "Sharing", "Speed", "First token",
                  "transformers, padded batch"):
        assert title in text
    assert f"{BYTES_PER_TOKEN:,}" in text
    md = bench.to_markdown(report)
    assert "**1. What one token costs**" in md and "| chats | runner |" in md and md.count("|---:|") >= 1


class _CountingProgress:
    def __init__(self):
        self.total, self.done, self.texts = None, 0, []

    def set_total(self, total):
        self.total = total

    def describe(self, text):
        self.texts.append(text)

    def advance(self, n=1):
        self.done += n


def test_repeat_alternates_rounds_and_shows_the_median(tiny_llama, report):
    progress = _CountingProgress()
    cfg = bench.BenchConfig(model=str(tiny_llama), chats=[1, 2], max_tokens=MAX_TOKENS, system_tokens=SYSTEM_TOKENS,
                            repeat=3, against="transformers", kv_cache_memory="1MiB")
    rep = bench.run_bench(cfg, progress)
    assert progress.done == progress.total  # the bar ends full
    assert [t for t in progress.texts if "2 chats" in t] == [
        "pagedchat · 2 chats · round 1 of 3", "transformers, padded batch · 2 chats · round 1 of 3",
        "pagedchat · 2 chats · round 2 of 3", "transformers, padded batch · 2 chats · round 2 of 3",
        "pagedchat · 2 chats · round 3 of 3", "transformers, padded batch · 2 chats · round 3 of 3",
        "transformers, one at a time · 2 chats"]
    for lv, single in zip(rep["levels"], report["levels"]):
        assert len(lv["rounds"]) == 3
        for r in lv["rounds"]:
            assert r["pagedchat"]["tokens"] == r["padded_batch"]["tokens"] == lv["chats"] * MAX_TOKENS
        for runner, shown in (("pagedchat", lv["engine"]), ("padded_batch", lv["transformers"]["padded_batch"])):
            rates = sorted(r[runner]["end_to_end_tokens_per_s"] for r in lv["rounds"])
            assert shown["end_to_end_tokens_per_s"] == rates[1]
        assert lv["ratios"]["vs_padded_batch"] == pytest.approx(
            lv["engine"]["end_to_end_tokens_per_s"] / lv["transformers"]["padded_batch"]["end_to_end_tokens_per_s"])
        assert lv["sharing"] == single["sharing"]  # the accounting does not depend on the round
    assert "3 rounds of pagedchat" in bench.header_lines(rep)[1]


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
        work = bench.build_workload(tok, s, 30, seed=3)
        assert len(work.system_ids) == s
        assert all(p[:s] == work.system_ids for p in work.prompts)
        assert len(set(work.questions)) == 30  # more chats than stock questions: still distinct
        cold = work.cold_prefix(5)
        assert len(cold) == s and cold[:BLOCK] != work.system_ids[:BLOCK]
        assert cold[:BLOCK] != work.cold_prefix(6)[:BLOCK]
    assert bench.build_workload(tok, 40, 4, seed=1).questions == bench.build_workload(tok, 40, 4, seed=1).questions


def test_stats():
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    assert bench.percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    st = bench.timing_stats(0.0, [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]])
    assert st["tokens"] == 6 and st["end_to_end_tokens_per_s"] == pytest.approx(6 / 3.5)
    assert st["ttft_p50_s"] == pytest.approx(1.25)
    assert st["itl_p50_s"] == pytest.approx(1.0)
    # decode: from 1.5 s (both chats started) to 3.5 s, the 4 tokens after 1.5 s
    assert st["decode_tokens_per_s"] == pytest.approx(4 / 2.0)
