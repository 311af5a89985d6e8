"""`pagedchat bench --prefill` on a tiny model: a cold prompt of each length, timed, none of it from the cache."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedchat import Engine
from pagedchat.backends.local import LocalBackend
from pagedchat.bench.options import prompt_lengths
from pagedchat.bench.prefill import PrefillReport, PrefillRound, prompts_of, render, run_prefill_bench, \
    usable_lengths
from pagedchat.bench.workload import build_workload
from pagedchat.cli import main
from tiny_models import make_tiny_model


def test_every_prompt_has_its_length_and_a_start_of_its_own(tmp_path):
    engine = Engine(make_tiny_model(tmp_path / "tiny", max_positions=2048), kv_cache_memory="8MiB", dtype="float32")
    lengths = [64, 300]
    prompts = prompts_of(build_workload(engine.tokenizer, 300, 1, seed=0), lengths, rounds=2)
    assert {k: len(p) for k, p in prompts.items()} == {(64, 0): 64, (300, 0): 300, (64, 1): 64, (300, 1): 300}
    firsts = [tuple(p[:16]) for p in prompts.values()]
    assert len(set(firsts)) == len(firsts)   # no first page in common: no prefix cache hit
    report = run_prefill_bench(LocalBackend(engine), None, prompts, lengths, repeat=2, progress=lambda line: None)
    assert [(r.runner, r.tokens) for r in report.rounds] == [("pagedchat", 64), ("pagedchat", 300)] * 2
    assert engine.memory().cached_pages >= (64 + 300) * 2 // 16 - 4   # each prompt prefilled, its pages cached
    assert "over shortest" in render(report)


def test_lengths_fit_the_context_and_ratios_come_from_medians():
    assert usable_lengths([512, 8192, 9000], 8192) == [512, 8191]
    with pytest.raises(argparse.ArgumentTypeError):
        prompt_lengths("512,-1")
    report = PrefillReport([100, 400], ["pagedchat", "llama.cpp"], [
        PrefillRound("pagedchat", 100, 1.0), PrefillRound("llama.cpp", 100, 2.0),
        PrefillRound("pagedchat", 400, 8.0), PrefillRound("llama.cpp", 400, 4.0)])
    assert report.over_shortest("pagedchat", 400) == 0.5
    assert report.tokens_per_s("pagedchat", 400) / report.tokens_per_s("llama.cpp", 400) == 0.5
    assert "pagedchat over llama.cpp" in render(report)


def test_the_cli_runs_it(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "tiny", max_positions=256)
    out = tmp_path / "prefill.json"
    assert main(["bench", "--prefill", "32,1000", "--model", str(folder), "--dtype", "float32",
                 "--kv-cache-memory", "4MiB", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["lengths"] == [32, 255]   # 1000 is past the context: cut to fit
    assert "255" in capsys.readouterr().out
