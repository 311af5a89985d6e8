"""`pagedchat bench --flood` on a tiny model: short requests alone and beside floods of n, their latencies
kept and summarised, and every flood's pages back in the pool."""

from __future__ import annotations

import json

import pytest

from pagedchat import Engine
from pagedchat.backends.local import LocalBackend
from pagedchat.bench.flood import INNOCENTS, FloodReport, Latency, render, run_flood_bench
from pagedchat.bench.workload import build_workload
from pagedchat.cli import main
from tiny_models import make_tiny_model


def test_short_requests_beside_a_flood_are_timed_and_the_pages_come_back(tmp_path):
    engine = Engine(make_tiny_model(tmp_path / "tiny", max_positions=2048), kv_cache_memory="2MiB",
                    dtype="float32", max_seqs=32)
    prompts = build_workload(engine.tokenizer, 40, INNOCENTS + 1, seed=0).prompts
    lines = []
    report = run_flood_bench(LocalBackend(engine), prompts[1:], prompts[0], flood_tokens=400, repeat=1,
                             progress=lines.append)
    assert [x.beside for x in report.latencies] == ["alone"] * INNOCENTS + ["flood"] * INNOCENTS
    assert all(0 < x.first_token_s <= x.whole_s for x in report.latencies)
    assert report.pages_back
    assert len(lines) == 2 and "flood" in render(report)


def test_quantiles_come_from_each_condition_alone():
    latencies = [Latency("alone", 0.01 * i, 0.1 * i) for i in range(1, 101)] + [Latency("flood", 5.0, 9.0)] * 3
    report = FloodReport(4, 16, 512, 16, latencies, True)
    # Interpolated between the samples, as statistics.quantiles' inclusive method does.
    assert report.rows()[0] == ("alone", *map(pytest.approx, (0.505, 0.9901, 5.05, 9.901)))
    assert report.rows()[1] == ("flood", 5.0, 5.0, 9.0, 9.0)


def test_the_cli_runs_it(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "flood.json"
    assert main(["bench", "--flood", "--model", str(folder), "--max-tokens", "40", "--system-tokens", "40",
                 "--dtype", "float32", "--kv-cache-memory", "4MiB", "--json", str(out)]) == 0
    assert "every page back after each flood: yes" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["table"]) == 2
