"""`pagedchat bench --speculation`: speculation against off, alternating, on a tiny random model."""

from __future__ import annotations

import argparse

from tiny_models import make_tiny_model

from pagedchat import bench
from pagedchat.bench.options import BenchConfig
from pagedchat.bench.speculative import render_speculation, run_speculation


def test_the_copy_workload_drafts_and_both_runs_give_the_same_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_ATTENTION", "torch")  # verified drafts equal single steps here (docs/speculative.md)
    folder = make_tiny_model(tmp_path / "llama", "llama", tie=True)
    cfg = BenchConfig(model=str(folder), chats=(1, 2), max_tokens=24, repeat=2, dtype="float32")
    report = run_speculation(cfg, "copy", "ngram")
    assert [level.chats for level in report.levels] == [1, 2]
    # every level asks each of the four copy requests once: at one chat in four waves, at two in two
    assert [len(level.spec[0].tokens) for level in report.levels] == [4, 4]
    for level in report.levels:
        assert len(level.spec) == len(level.off) == 2 and level.same_tokens
        assert level.ratio > 0
    assert sum(r.drafted for level in report.levels for r in level.spec) > 0
    assert "same tokens: yes" in render_speculation(report)


def test_the_flags_pick_the_mode_and_workload(capsys):
    parser = argparse.ArgumentParser(prog="pagedchat bench")
    bench.add_arguments(parser)
    args = bench.with_defaults(parser.parse_args(["--speculation", "--workload", "copy", "--speculative", "off"]))
    assert bench.run(args) == 2
    assert "give --speculative auto or ngram" in capsys.readouterr().err
