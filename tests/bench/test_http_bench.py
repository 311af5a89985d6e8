"""`pagedchat bench --serve` on a tiny model: both runners produce the whole workload, and the report adds up."""

from __future__ import annotations

from pagedchat import Engine
from pagedchat.backends.local import LocalBackend
from pagedchat.bench.workload import build_workload
from pagedchat.cli import main
from pagedchat.bench.http import CLIENTS, run_serve_bench
from tiny_models import make_tiny_model


def test_http_and_engine_rounds_generate_the_same_tokens(tmp_path):
    engine = Engine(make_tiny_model(tmp_path / "tiny"), kv_cache_memory="4MiB", dtype="float32")
    prompts = build_workload(engine.tokenizer, 40, CLIENTS, seed=0).prompts
    lines = []
    report = run_serve_bench(LocalBackend(engine), prompts, max_tokens=5, repeat=2, system_tokens=40,
                             progress=lines.append)
    assert [r.runner for r in report.rounds] == ["engine", "http"] * 2
    assert {r.tokens for r in report.rounds} == {CLIENTS * 5}
    assert len(lines) == 4


def test_the_cli_runs_it(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "serve.json"
    assert main(["bench", "--serve", "--model", str(folder), "--max-tokens", "3", "--system-tokens", "40",
                 "--dtype", "float32", "--kv-cache-memory", "4MiB", "--json", str(out)]) == 0
    assert "overhead" in capsys.readouterr().out
    assert out.read_text().count('"runner"') == 2
