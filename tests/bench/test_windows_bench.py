"""`pagedchat bench --windows`: one long chat's peak KV memory on a tiny random Gemma-3-shaped model, with the
window layers' passed pages released and kept."""

from __future__ import annotations

import argparse
import json

from tiny_models import make_tiny_model

from pagedchat import bench

WINDOW = 32
PROMPT, REPLY = 40, 120  # the chat leaves the window three pages and more behind


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedchat bench")
    bench.add_arguments(parser)
    return bench.with_defaults(parser.parse_args(argv))


def test_windows_defaults_to_a_long_reply():
    assert _parse(["--windows"]).max_tokens == 4096
    assert _parse(["--windows", "--max-tokens", "9"]).max_tokens == 9


def test_a_long_gemma3_chat_peaks_lower_with_its_window_pages_released(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", layers=6, window=WINDOW)
    out = tmp_path / "windows.json"
    args = _parse(["--windows", "--model", str(folder), "--system-tokens", str(PROMPT), "--max-tokens", str(REPLY),
                   "--dtype", "float32", "--json", str(out)])
    assert bench.run(args) == 0
    figures = json.loads(out.read_text())
    assert figures["tokens"] == PROMPT + REPLY
    assert figures["groups"] == ["1 layer, global", f"5 layers, window {WINDOW}"]
    kept, released = figures["kept"], figures["released"]
    # Kept: every layer holds all ten pages of the chat. Released: the global layer does, the window layers at
    # most the pages their window and the last prefill chunk reach.
    page = 2 * 2 * 16 * 4 * 16  # K and V, 2 kv heads, head_dim 16, float32, 16 tokens: one layer's page
    pages = -(-(PROMPT + REPLY) // 16)
    assert kept["peak_bytes"] == 6 * pages * page and len(kept["group_peaks"]) == 1
    assert released["group_peaks"][0] == pages * page
    assert released["group_peaks"][1] <= 5 * page * (-(-PROMPT // 16) + -(-WINDOW // 16) + 1)
    assert released["peak_bytes"] < kept["peak_bytes"] / 2
    text = capsys.readouterr().out
    assert "window pages kept" in text and "window pages released" in text and "less KV memory" in text


def test_a_model_without_windows_is_refused_in_one_line(tiny_llama, capsys):
    assert bench.run(_parse(["--windows", "--model", str(tiny_llama), "--max-tokens", "4"])) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pagedchat bench: ") and "has no sliding-window layers" in err
