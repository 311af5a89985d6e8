"""`pagedchat bench --app`: the real app on a pseudo-terminal against the engine alone, on a tiny model."""

from __future__ import annotations

import pytest

from pagedchat.bench.app_probe import app_args, run_app_probe
from pagedchat.errors import PagedChatError
from tiny_models import make_tiny_model

OPTIONS = {"dtype": "float32", "kv_cache_memory": "4MiB"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("probe-model"), seed=3, max_positions=1024))


def test_app_and_engine_alone_write_the_same_reply_and_both_are_timed(model):
    lines = []
    report = run_app_probe(model, repeat=2, max_tokens=12, options=OPTIONS, prompt="hello there",
                           progress=lines.append)
    assert len(report.rounds) == 2 and len(lines) == 2
    for r in report.rounds:
        assert r.app.prompt_tokens == r.engine.prompt_tokens > 0  # the probe refuses otherwise
        assert r.app.text and r.app.text == r.engine.text  # float32: the same greedy reply, cached prefix or not
        assert 0 < r.app.tokens == r.engine.tokens <= 12
        assert r.app.tokens_per_s > 0 and r.engine.tokens_per_s > 0
    assert report.ratio > 0


def test_the_app_gets_the_engine_options_as_its_flags():
    args = app_args("m", 40, {"kv_cache_memory": "4MiB", "dtype": "float32"})
    assert args[-6:] == ["--kv-cache-memory", "4MiB", "--dtype", "float32", "--model", "m"]
    assert args[args.index("--max-tokens") + 1] == "40" and "--temperature" in args


def test_a_model_that_cannot_load_is_one_clear_error(tmp_path):
    with pytest.raises(PagedChatError) as caught:
        run_app_probe(str(tmp_path / "missing"), repeat=1, max_tokens=4, options=OPTIONS)
    assert "missing" in str(caught.value)


@pytest.mark.slow  # the same probe on four tabs: the one-tab test times the app and the engine
def test_four_tabs_generate_at_once_and_keys_typed_meanwhile_are_timed(model):
    options = dict(OPTIONS, kv_cache_memory="64MiB")   # four replies at once
    report = run_app_probe(model, repeat=1, max_tokens=500, options=options, prompt="hello there", tabs=4)
    [r] = report.rounds
    assert r.app.text == r.engine.text   # four chats, each the engine's own reply (float32), in one order
    assert r.app.prompt_tokens == r.engine.prompt_tokens and r.app.tokens == r.engine.tokens > 4
    # A tiny model may finish a reply before the last tab starts: then no key is timed (the echo itself is timed
    # on the default model, in the bench).
    assert all(0 < e < 30 for e in r.echoes_s)


def test_more_tabs_than_prompts_is_refused(model):
    with pytest.raises(PagedChatError, match="1 to 4 tabs"):
        run_app_probe(model, repeat=1, max_tokens=4, options=OPTIONS, tabs=5)
