"""Sliding-window pages released, on real tiny models against transformers in float32: chats longer than the
window by several pages keep only the pages their windows reach in the window layers' pool (the global layers
keep theirs), under preemption and with a shared system prompt longer than the window, and every greedy token
stays equal to transformers' run of that chat alone."""

from __future__ import annotations

import json

import pytest
from parity import assert_same_greedy
from tiny_models import hf_greedy, load_reference, make_tiny_model

from pagedchat import Engine, SamplingParams
from pagedchat.engine.kv_snapshot import MemorySnapshot
from pagedchat.engine.records import NULL_PAGE
from pagedchat.errors import RequestError
from pagedchat.model.hf_config import ModelConfig

NO_EOS = [10**9]
BS = 16
WINDOW = 24           # the reach of a decoding query: at most ceil(24 / 16) + 1 pages
WINDOW_PAGES = 3
CHUNK = 64            # max_tokens_per_step: a prefill chunk's pages come on top of the window's
MODELS = {"gemma3": dict(arch="gemma3", layers=6, window=WINDOW),      # five window layers to one global
          "mistral": dict(arch="mistral", layers=2, window=WINDOW, tie=False)}  # every layer windowed
# A pool too small for 4 chats of 120 tokens: the global layers' pages are the tight ones in Gemma 3; with
# every layer windowed, a chat holds 3 or 4 pages, so fewer than 4 chats' worth of those.
TIGHT = {"gemma3": 14, "mistral": 10}


@pytest.fixture(scope="module", params=MODELS)
def windowed_model(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), **MODELS[request.param])
    return folder, load_reference(folder), TIGHT[request.param]


def full_page(folder) -> int:
    return ModelConfig.from_folder(folder).kv_bytes_per_token(4) * BS


def engine_of(folder, pages: int, release: bool = True, speculative: str = "auto") -> Engine:
    page = full_page(folder)
    return Engine(str(folder), kv_cache_memory=pages * page, swap_space=8 * page, dtype="float32", autostart=False,
                  max_seqs=8, max_tokens_per_step=CHUNK, release_windows=release, speculative=speculative)


def run(engine: Engine, prompts, max_tokens: int) -> tuple[list, int]:
    """Every chat to its end, checking the pools after each step; returns the handles and the peak bytes in use."""
    handles = engine.submit_many(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    peak = 0
    while engine.has_work():
        engine.step()
        running = engine.scheduler.running
        engine.pages.check_invariants(engine.scheduler.all_seqs())
        for manager, used in zip(engine.pages.groups, engine.pages.pages_used()):
            if manager.window is not None:
                bound = len(running) * (WINDOW_PAGES + 1) + CHUNK // BS
                assert used <= bound, f"{used} window pages in use for {len(running)} running chats"
        peak = max(peak, engine.usage().bytes_used)
    return handles, peak


def test_chats_longer_than_the_window_release_its_pages_and_equal_transformers(windowed_model):
    """4 chats of 20 prompt tokens and 100 replies (the window's 24 tokens and 6 pages more) in a pool that
    cannot hold them all: preempted, released, and exact; the same run keeping every page peaks higher. Without
    speculation: drafts change which steps preempt, and so the peaks, whose comparison is about the window."""
    folder, ref, tight = windowed_model
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(20)] for i in range(4)]
    engine = engine_of(folder, pages=tight, speculative="off")
    handles, peak = run(engine, prompts, 100)
    assert sum(m.counters.window_released for m in engine.pages.groups) > 0
    counters = engine.pages.counters
    assert counters.swap_outs + counters.recomputes > 0, "the pool was meant to be too small for all 4"
    for prompt, handle in zip(prompts, handles):
        assert_same_greedy(ref, prompt, handle.result().token_ids, hf_greedy(ref, prompt, 100, NO_EOS))
    engine.shutdown()

    keeping = engine_of(folder, pages=tight, release=False, speculative="off")
    kept, kept_peak = run(keeping, prompts, 100)
    assert [h.result().token_ids for h in kept] == [h.result().token_ids for h in handles]
    assert peak < kept_peak, "releasing the window layers' pages takes less memory"
    keeping.shutdown()


def test_a_shared_system_prompt_longer_than_the_window_is_shared_and_released(windowed_model):
    """8 chats on a 70-token system prompt (the window and three pages more): later chats map its pages from the
    prefix cache, the window layers only those in reach of where they start, and every reply stays exact."""
    folder, ref, _ = windowed_model
    engine = engine_of(folder, pages=20)
    system = [(11 * j) % 190 + 7 for j in range(70)]
    prompts = [system + [200 + i, 201, 202 + i] for i in range(8)]
    handles, _ = run(engine, prompts, 40)
    assert sum(h.result().cached_tokens for h in handles) >= 7 * 64, "the system prompt's full pages were shared"
    for manager in engine.pages.groups:
        if manager.window is not None:
            assert manager.counters.window_released > 0
    for prompt, handle in zip(prompts, handles):
        assert_same_greedy(ref, prompt, handle.result().token_ids, hf_greedy(ref, prompt, 40, NO_EOS))
    engine.shutdown()


def test_f2s_snapshot_reports_each_groups_pages_in_bytes_and_the_released_ones(windowed_model):
    folder, _, _ = windowed_model
    engine = engine_of(folder, pages=20)
    handle = engine.submit([(5 * j) % 150 + 9 for j in range(60)], SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(3):
        engine.step()
    snap = engine.memory()
    windowed = [g for g in snap.groups if g.window == WINDOW]
    assert len(windowed) == 1 and windowed[0].released_pages > 0
    seq = next(s for s in engine.scheduler.running if s.request_id == handle.request_id)
    group = next(i for i, m in enumerate(engine.pages.groups) if m.window == WINDOW)
    assert windowed[0].released_pages == seq.table(group).block_table.count(NULL_PAGE)
    assert snap.window_released_bytes == windowed[0].released_pages * windowed[0].page_bytes
    assert snap.paged_bytes == sum(g.used_pages * g.page_bytes for g in snap.groups)
    assert sum(g.page_bytes for g in snap.groups) == full_page(folder), "a block of every group is a full page"
    assert MemorySnapshot.from_json(json.loads(json.dumps(snap.to_json()))) == snap, "as /v1/memory sends it"
    engine.shutdown()


def test_a_chat_longer_than_the_pool_runs_when_every_layer_releases(tmp_path):
    """With every layer windowed a chat never holds more than its window and one chunk: a 13-page chat runs in an
    8-page pool, exactly, where keeping every page refuses it."""
    folder = make_tiny_model(tmp_path / "mistral", **MODELS["mistral"])
    ref = load_reference(folder)
    prompt = [(3 * j) % 200 + 5 for j in range(40)]
    engine = Engine(str(folder), kv_cache_memory=8 * full_page(folder), dtype="float32", max_tokens_per_step=CHUNK)
    out = engine.generate(prompt, SamplingParams(max_tokens=160, ignore_eos=True))[0]
    assert_same_greedy(ref, prompt, out.token_ids, hf_greedy(ref, prompt, 160, NO_EOS))
    engine.shutdown()
    keeping = Engine(str(folder), kv_cache_memory=8 * full_page(folder), dtype="float32", release_windows=False)
    with pytest.raises(RequestError, match=r"can grow to 200 tokens \(13 pages\) but the KV cache holds 8 pages"):
        keeping.submit(prompt, SamplingParams(max_tokens=160, ignore_eos=True))
    keeping.shutdown()


def test_n_replies_fork_a_prompt_longer_than_the_window_and_stay_exact(windowed_model):
    """n > 1: the siblings map the parent's prompt pages, the window layers' only as far back as the window of
    the last prompt token, which each computes again; every reply equals transformers'."""
    folder, ref, _ = windowed_model
    engine = engine_of(folder, pages=20)
    prompt = [(13 * j) % 180 + 11 for j in range(70)]
    handles = engine.submit_many([prompt], SamplingParams(max_tokens=30, ignore_eos=True), n=3)
    peak_released = 0
    while engine.has_work():
        engine.step()
        engine.pages.check_invariants(engine.scheduler.all_seqs())
        peak_released = max(peak_released, sum(g.released_pages for g in engine.memory().groups))
    assert peak_released >= 3 * 2, "each sibling's table holds released entries"
    want = hf_greedy(ref, prompt, 30, NO_EOS)
    for handle in handles:
        assert_same_greedy(ref, prompt, handle.result().token_ids, want)
    engine.shutdown()


def test_the_backend_declares_the_pool_in_bytes_over_every_group(windowed_model):
    """The status line and the bench size the pool from BackendInfo: with window groups, whose pools are
    smaller, the pool's bytes are the groups' own, not the first group's pages at a full page each."""
    from pagedchat.backends.local import LocalBackend
    from pagedchat.bench.capacity import token_cost

    folder, _, _ = windowed_model
    engine = engine_of(folder, pages=40)
    info = LocalBackend(engine).info
    snap = engine.memory()
    assert info.pool_bytes == snap.pool_bytes == sum(g.num_pages * g.page_bytes for g in snap.groups)
    # Gemma 3's window group has fewer pages than its global one; Mistral's one group is the whole pool.
    assert (info.pool_bytes < info.num_pages * info.page_bytes) == (len(snap.groups) > 1)
    assert token_cost(engine.config, engine.kv_dtype, info).pool_bytes == info.pool_bytes
    engine.shutdown()
