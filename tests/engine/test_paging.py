"""The memory manager with a real (tiny, random) model: sharing, forks, multi-turn reuse, pressure, chunking.

Every test that produces tokens also checks them against transformers' greedy run of the same history, so
a page mapped, copied, swapped or evicted wrongly shows up as a wrong token. Page budgets are given in pages:
one token of the default tiny model's K/V takes 768 bytes, so one page of 16 tokens takes 12288.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedchat import Engine, SamplingParams
from pagedchat.engine.chat_template import chat_prompt_ids
from pagedchat.engine.core import Phase
from pagedchat.errors import RequestError
from pagedchat.kernels import kv_pages
from pagedchat.model.hf_config import ModelConfig
from parity import NEAR_TIE, NEAR_TIE_PACKED, assert_same_greedy
from tiny_models import hf_greedy, load_reference, make_tiny_model

PAGE = 12288  # bytes of one 16-token page of the default tiny model (3 layers)
NO_EOS = [10**9]  # transformers runs to max_new_tokens, like ignore_eos


def text_of(tokenizer, n: int, salt: int = 0) -> str:
    words = " ".join(f"fox {salt} jumps over dog {i}, paged blocks hold keys." for i in range(n))
    return tokenizer.decode(tokenizer.encode(words)[:n])


def ids_of(tokenizer, n: int, salt: int = 0) -> list[int]:
    words = " ".join(f"fox {salt} jumps over dog {i}, paged blocks hold keys." for i in range(n))
    return tokenizer.encode(words)[:n]


def manual(folder, **kwargs) -> Engine:
    """An engine driven step by step on this thread."""
    return Engine(str(folder), autostart=False, **kwargs)


def step(engine: Engine) -> dict[str, list[int]]:
    """One step (it delivers to the handles); returns the new token ids per request."""
    got: dict[str, list[int]] = {}
    for update in engine.step():
        got.setdefault(update.request_id, []).extend(update.token_ids)
    return got


def drain(engine: Engine, limit: int = 5000, check=None) -> int:
    steps = 0
    while engine.has_work():
        step(engine)
        steps += 1
        if check:
            check()
        assert steps < limit, "the engine makes no progress"
    return steps


def live_tables(engine: Engine) -> list[list[int]]:
    return [s.table(0).block_table for s in engine.scheduler.all_seqs()]


_reference: dict[tuple, list[int]] = {}


def reference(ref, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy run, cached: several tests and examples ask for the same one."""
    key = (id(ref), tuple(prompt), max_tokens)
    if key not in _reference:
        _reference[key] = hf_greedy(ref, prompt, max_tokens, NO_EOS)
    return _reference[key]


def check_same(ref, prompt, out, max_tokens):
    assert len(out) == max_tokens
    assert_same_greedy(ref, prompt, out, reference(ref, prompt, max_tokens))


# ---- prefix sharing ------------------------------------------------------------------------------------------
def test_shared_prefix_pages_are_mapped_not_computed(tiny_llama, tiny_llama_ref):
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    common = ids_of(eng.tokenizer, 48)
    pa, pb = common + ids_of(eng.tokenizer, 7, 1), common + ids_of(eng.tokenizer, 5, 2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = eng.submit(pa, params)
    step(eng)
    b = eng.submit(pb, params)
    step(eng)
    snap = eng.memory()
    pages_a, pages_b = snap.seqs[a.request_id].pages, snap.seqs[b.request_id].pages
    assert pages_b[:3] == pages_a[:3] and len(pages_b) == 4 and pages_b[3] not in pages_a
    assert [snap.ref_counts[p] for p in pages_a[:3]] == [2, 2, 2]
    assert snap.shared_pages == {p: [a.request_id, b.request_id] for p in pages_a[:3]}
    assert b.so_far().cached_tokens == 48 and b.so_far().prefilled_tokens == 5
    assert snap.used_pages == 5
    drain(eng)
    check_same(tiny_llama_ref, pa, a.result().token_ids, 8)
    check_same(tiny_llama_ref, pb, b.result().token_ids, 8)
    assert eng.memory().free_pages == eng.memory().num_pages


# ---- fork ----------------------------------------------------------------------------------------------------
def test_fork_of_a_live_request_shares_pages_and_continues_like_a_fresh_run(tiny_llama, tiny_llama_ref):
    eng = manual(tiny_llama, kv_cache_memory="2MiB", speculative="off")  # one token a step: the fork point is exact
    prompt = ids_of(eng.tokenizer, 40)
    reply: list[int] = []
    parent = eng.submit(prompt, SamplingParams(max_tokens=30, ignore_eos=True),
                        on_update=lambda u: reply.extend(u.token_ids))
    step(eng)
    while len(reply) < 11:  # 51 tokens, 50 computed: page 3 is partial
        step(eng)
    before = list(eng.memory().seqs[parent.request_id].pages)
    history = prompt + reply
    child = eng.fork(parent.request_id, SamplingParams(max_tokens=20, ignore_eos=True))
    step(eng)
    snap = eng.memory()
    pp, cp = snap.seqs[parent.request_id].pages, snap.seqs[child.request_id].pages
    assert eng.pages.first.counters.cow_copies == 1, "one write into the shared partial page, one copy"
    assert pp[:3] == cp[:3] == before[:3] and all(snap.ref_counts[p] == 2 for p in pp[:3])
    assert pp[3] != cp[3] and before[3] in (pp[3], cp[3]), "the partial page was copied for one writer"
    assert snap.ref_counts[pp[3]] == snap.ref_counts[cp[3]] == 1
    # the child's prompt is the parent's 51 tokens: 50 computed and shared, the last one its own to compute
    assert snap.seqs[child.request_id].cached_tokens == 50 and child.so_far().prefilled_tokens == 1
    drain(eng, check=lambda: eng.pages.first.check_invariants(live_tables(eng)))
    assert child.prompt_token_ids == history
    check_same(tiny_llama_ref, prompt, parent.result().token_ids, 30)
    check_same(tiny_llama_ref, history, child.result().token_ids, 20)
    assert eng.memory().free_pages == eng.memory().num_pages
    # a finished request forks from the prefix cache
    again = eng.fork(child.request_id, SamplingParams(max_tokens=5, ignore_eos=True))
    drain(eng)
    done = again.result()
    full = history + child.result().token_ids
    assert done.prompt_token_ids == full and done.cached_tokens == (len(full) - 1) // 16 * 16
    check_same(tiny_llama_ref, full, done.token_ids, 5)


def test_a_forks_first_update_tells_the_reply_text_it_continues(tiny_llama):
    """The parent may grow between fork() and the engine taking the fork in: the first update says from where."""
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    decode = lambda ids: eng.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    streamed: list[int] = []
    parent = eng.submit(ids_of(eng.tokenizer, 20), SamplingParams(max_tokens=12, ignore_eos=True),
                        on_update=lambda u: streamed.extend(u.token_ids))
    for _ in range(6):
        step(eng)
    live = eng.fork(parent.request_id, SamplingParams(max_tokens=3, ignore_eos=True))
    reply_so_far = list(streamed)   # as it stands: the next step takes the fork in first
    drain(eng)
    updates = list(live)
    assert reply_so_far and updates[0].inherited == decode(reply_so_far)
    assert all(u.inherited is None for u in updates[1:])
    ended = eng.fork(parent.request_id, SamplingParams(max_tokens=2, ignore_eos=True))
    drain(eng)
    assert next(iter(ended)).inherited == decode(parent.result().token_ids)
    assert all(u.inherited is None for u in parent)


@pytest.mark.parametrize("prompt_len", [40, 33])   # the last prompt token mid-page, and first on its page
def test_n_replies_compute_the_prompt_once_and_share_its_pages(tiny_llama, tiny_llama_ref, prompt_len):
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    prompt = ids_of(eng.tokenizer, prompt_len)
    handles = eng.submit_many([prompt], SamplingParams(max_tokens=12, ignore_eos=True), n=3)
    step(eng)   # the parent's prefill; then its siblings map the pages holding all but the last prompt token
    snap = eng.memory()
    shared = -(-(prompt_len - 1) // 16)
    pages = [snap.seqs[h.request_id].pages for h in handles]
    assert pages[1] == pages[2] == pages[0][:shared] and all(snap.ref_counts[p] == 3 for p in pages[1])
    step(eng)   # each sibling computes the last prompt token again: into a copy of the shared partial page,
    # where it is one (two copies: the last writer has the original to itself), else into a page of its own
    assert eng.pages.first.counters.cow_copies == (2 if prompt_len % 16 != 1 else 0)
    drain(eng, check=lambda: eng.pages.first.check_invariants(live_tables(eng)))
    results = [h.result() for h in handles]
    assert sum(r.prefilled_tokens for r in results) == prompt_len + 2    # one prefill, and 1 token each sibling
    assert results[1].cached_tokens == results[2].cached_tokens == prompt_len - 1
    for r in results:   # greedy replies are the same whatever the sharing
        check_same(tiny_llama_ref, prompt, r.token_ids, 12)
    assert eng.memory().free_pages == eng.memory().num_pages


def test_n_seeded_replies_differ_and_repeat(tiny_llama):
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)

    def texts() -> list[list[int]]:
        handles = eng.submit_many([ids_of(eng.tokenizer, 20)], params, n=3)
        drain(eng)
        return [h.result().token_ids for h in handles]

    first = texts()
    assert len({tuple(t) for t in first}) == 3 and texts() == first


def test_a_cancelled_parent_leaves_its_siblings_to_run(tiny_llama, tiny_llama_ref):
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    prompt = ids_of(eng.tokenizer, 30)
    parent, sibling = eng.submit_many([prompt], SamplingParams(max_tokens=6, ignore_eos=True), n=2)
    eng.cancel(parent.request_id)
    drain(eng)
    assert parent.result().finish_reason == "cancelled"
    check_same(tiny_llama_ref, prompt, sibling.result().token_ids, 6)


# ---- preemption ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("swap_pages", [0, 2, 32])
def test_preemption_keeps_outputs_exact(tiny_llama, tiny_llama_ref, swap_pages):
    """Four chats growing to 4 pages each in an 8-page pool: the newest are preempted (swapped out when the CPU
    tier has room, else dropped and recomputed), and every output still equals its run alone."""
    eng = manual(tiny_llama, kv_cache_memory=8 * PAGE, swap_space=swap_pages * PAGE)
    prompts = [ids_of(eng.tokenizer, n, salt=i) for i, n in enumerate((20, 9, 25, 14))]
    handles = eng.submit_many(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    drain(eng, check=lambda: eng.pages.first.check_invariants(live_tables(eng)))
    c = eng.pages.first.counters
    if swap_pages == 0:
        assert c.recomputes > 0 and c.swap_outs == 0
    elif swap_pages == 32:
        assert c.swap_outs > 0 and c.swap_ins == c.swap_outs
    else:
        assert c.swap_outs + c.recomputes > 0
    for prompt, handle in zip(prompts, handles):
        check_same(tiny_llama_ref, prompt, handle.result().token_ids, 40)
    snap = eng.memory()
    assert snap.free_pages == snap.num_pages and snap.cpu_swapped == 0


# ---- multi-turn ----------------------------------------------------------------------------------------------
def test_second_turn_reuses_prompt_and_generated_pages(tiny_llama, tiny_llama_ref):
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    tok = eng.tokenizer
    messages = [{"role": "user", "content": text_of(tok, 58)}]
    prompt = chat_prompt_ids(tok, messages)
    assert 95 <= len(prompt) <= 110
    h1 = eng.submit(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    drain(eng)
    first = h1.result()
    assert len(first.token_ids) == 50
    reply = tok.decode(first.token_ids, skip_special_tokens=False)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and what about the dog?"}]
    previous = prompt + first.token_ids
    prompt2 = chat_prompt_ids(tok, messages, previous_ids=previous)
    assert prompt2[:len(previous)] == previous, "the generated ids themselves enter the history"
    new = len(prompt2) - len(previous)
    h2 = eng.submit(prompt2, SamplingParams(max_tokens=10, ignore_eos=True))
    drain(eng)
    second = h2.result()
    assert second.cached_tokens >= 144
    assert second.prefilled_tokens <= new + 16
    assert second.cached_tokens + second.prefilled_tokens == len(prompt2)
    check_same(tiny_llama_ref, prompt2, second.token_ids, 10)


# ---- chunked prefill -----------------------------------------------------------------------------------------
def test_long_prefill_is_chunked_and_never_stalls_decodes(tiny_llama, tiny_llama_ref):
    # Without speculation, whose drafts would take from the prefill budget that this test counts.
    eng = manual(tiny_llama, kv_cache_memory="2MiB", max_tokens_per_step=64, speculative="off")
    short = [ids_of(eng.tokenizer, 10, 1), ids_of(eng.tokenizer, 12, 2)]
    a, b = eng.submit_many(short, SamplingParams(max_tokens=40, ignore_eos=True))
    step(eng)
    step(eng)  # both decoding now
    long_prompt = ids_of(eng.tokenizer, 400, 3)
    assert len(long_prompt) == 400
    c = eng.submit(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    prefill_steps = 0
    while not c.so_far().generated_tokens:
        before = {s.request_id: s.num_computed for s in eng.scheduler.all_seqs()}
        got = step(eng)
        after = {s.request_id: s.num_computed for s in eng.scheduler.all_seqs()}
        assert len(got.get(a.request_id, [])) == 1 and len(got.get(b.request_id, [])) == 1, \
            "a decoding chat missed its token while the long prompt was prefilled"
        assert sum(after[r] - before.get(r, 0) for r in after) <= 64
        prefill_steps += 1
        assert prefill_steps < 20
    assert prefill_steps == -(-400 // 62), "the long prompt takes what the two decodes leave of each step"
    drain(eng)
    check_same(tiny_llama_ref, long_prompt, c.result().token_ids, 8)
    for prompt, handle in zip(short, (a, b)):
        check_same(tiny_llama_ref, prompt, handle.result().token_ids, 40)


# ---- the CPU tier --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("swap_pages", [4, 16])
def test_idle_chat_is_offloaded_and_swapped_back_in(tiny_llama, tiny_llama_ref, swap_pages):
    """Chat A goes idle with 4 cached pages; chat B needs the whole pool, so A's pages are evicted: offloaded
    to the CPU tier, not dropped. A's next turn copies them back instead of recomputing them. With a tier of
    exactly 4 pages, the offloads that A's return causes must not overwrite the pages being read back."""
    eng = manual(tiny_llama, kv_cache_memory=12 * PAGE, swap_space=swap_pages * PAGE)
    pa = ids_of(eng.tokenizer, 60, 1)
    a = eng.submit(pa, SamplingParams(max_tokens=20, ignore_eos=True))
    drain(eng)
    history = pa + a.result().token_ids  # 80 tokens, 79 computed: 4 full pages cached
    assert eng.memory().cached_pages == 4
    pb = ids_of(eng.tokenizer, 170, 2)
    b = eng.submit(pb, SamplingParams(max_tokens=20, ignore_eos=True))
    drain(eng)
    c = eng.pages.first.counters
    assert c.evictions >= 4 and c.offloads >= 4
    snap = eng.memory()
    assert snap.cpu_cached >= 4 and snap.cpu_total == swap_pages
    prompt2 = history + ids_of(eng.tokenizer, 6, 3)
    a2 = eng.submit(prompt2, SamplingParams(max_tokens=10, ignore_eos=True))
    drain(eng)
    done = a2.result()
    assert done.cached_tokens == 64 and done.prefilled_tokens == len(prompt2) - 64
    assert eng.pages.first.counters.cpu_hits == 4, "A's four pages came back from the CPU tier"
    check_same(tiny_llama_ref, prompt2, done.token_ids, 10)
    check_same(tiny_llama_ref, pb, b.result().token_ids, 20)


# ---- a shared system prompt ----------------------------------------------------------------------------------
def test_eight_chats_share_one_system_prompt(tiny_llama, tiny_llama_ref, shared_prefix_reads):
    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    tok = eng.tokenizer
    system = text_of(tok, 280)
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}: what is {i}?"}]
             for i in range(8)]
    prompts = [chat_prompt_ids(tok, chat) for chat in chats]
    shared = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)
    assert 300 <= shared <= 310, shared
    max_tokens = 12
    handles = eng.submit_many(chats, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert [h.prompt_token_ids for h in handles] == prompts
    peak = 0

    def track():
        nonlocal peak
        snap = eng.memory()
        peak = max(peak, snap.used_pages)
        eng.pages.first.check_invariants(live_tables(eng))

    drain(eng, check=track)
    own = sum(eng.pages.first.pages_for(len(p) + max_tokens - 1) - 300 // 16 for p in prompts)
    assert peak <= 300 // 16 + own, (peak, own)
    unshared = sum(eng.pages.first.pages_for(len(p) + max_tokens - 1) for p in prompts)
    assert peak < unshared / 3, "the system prompt is held once, not once per chat"
    results = [h.result() for h in handles]
    assert sum(r.cached_tokens for r in results) >= 7 * (shared // 16) * 16
    assert shared_prefix_reads  # decode steps read the shared system prompt once for all chats
    for prompt, result in zip(prompts, results):
        check_same(tiny_llama_ref, prompt, result.token_ids, max_tokens)


# ---- requests that cannot fit --------------------------------------------------------------------------------
def test_a_request_larger_than_the_cache_is_refused_at_submit(tiny_llama, tiny_llama_ref):
    eng = manual(tiny_llama, kv_cache_memory=4 * PAGE)
    with pytest.raises(RequestError, match=r"can grow to 80 tokens \(5 pages\) but the KV cache holds 4 pages"):
        eng.submit(ids_of(eng.tokenizer, 50), SamplingParams(max_tokens=30))
    with pytest.raises(RequestError):  # one bad prompt fails the whole batch, before anything is queued
        eng.submit_many([ids_of(eng.tokenizer, 5), ids_of(eng.tokenizer, 70)], SamplingParams(max_tokens=10))
    assert not eng.has_work()
    prompt = ids_of(eng.tokenizer, 30)
    ok = eng.submit(prompt, SamplingParams(max_tokens=30, ignore_eos=True))  # 60 tokens: 4 pages, fits
    drain(eng)
    check_same(tiny_llama_ref, prompt, ok.result().token_ids, 30)


# ---- random operations ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-2l"), layers=2, seed=3)
    alone: dict[str, Engine] = {}
    runs: dict[tuple, list[int]] = {}

    def isolated(prompt: list[int], max_tokens: int, kv: str) -> list[int]:
        """The request run alone in an engine of its own with pages of kv (cached: examples repeat prompts)."""
        key = (kv, tuple(prompt), max_tokens)
        if key not in runs:
            engine = alone.setdefault(kv, manual(folder, kv_cache_memory="2MiB", kv_cache_dtype=kv))
            handle = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            drain(engine)
            runs[key] = handle.result(timeout=0).token_ids
        return runs[key]

    return folder, load_reference(folder), isolated


def small_page(folder, kv: str) -> int:
    """One page of the 2-layer model in pages of kv: 8192 bytes in float32 (512 a token)."""
    return kv_pages.token_bytes(ModelConfig.from_folder(folder), kv_pages.parse_kv_cache_dtype(kv)) * 16


ADD = st.tuples(st.just("add"), st.integers(0, 2), st.sampled_from([3, 16, 17, 30, 41, 50]), st.integers(1, 20))
OPS = st.one_of(
    ADD, ADD, ADD,
    st.tuples(st.just("step"), st.integers(0, 5)),
    st.tuples(st.just("fork"), st.integers(0, 20), st.integers(1, 8)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
    st.tuples(st.just("fault"), st.sampled_from(list(Phase))),
    st.tuples(st.just("shutdown")),
)


class OneFault:
    """A fault hook that raises once, at the end of the armed phase."""

    def __init__(self):
        self.armed: Phase | None = None

    def __call__(self, phase: Phase, request_id: str | None) -> None:
        if phase is self.armed:
            self.armed = None
            raise RuntimeError(f"injected into {phase.value}")


@settings(max_examples=30 * int(os.environ.get("PAGEDCHAT_FUZZ", "1")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=10, max_size=30), swap_pages=st.sampled_from([0, 3, 20]),
       kv=st.sampled_from(["float32", "bfloat16", "int8"]))
def test_random_operations_keep_pages_consistent_and_outputs_exact(small_model, ops, swap_pages, kv):
    """At every page dtype: a request's tokens are its run alone in an engine of the same pages (copies move every
    byte, an int8 row's scale included), or transformers' up to near-ties (the page dtype's tolerance)."""
    folder, ref, isolated = small_model
    fault = OneFault()
    page = small_page(folder, kv)
    eng = manual(folder, kv_cache_memory=5 * page, swap_space=swap_pages * page,
                 max_tokens_per_step=24, max_seqs=4, fault_hook=fault, kv_cache_dtype=kv)
    bases = [ids_of(eng.tokenizer, 60, salt) for salt in range(3)]
    handles, wanted = [], {}  # wanted: request id -> max_tokens

    def submit(make, max_tokens):
        handle = make(SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        handles.append(handle)
        wanted[handle.request_id] = max_tokens

    def check():
        eng.pages.first.check_invariants(live_tables(eng))

    def pick(i):
        return handles[i % len(handles)] if handles else None

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, base, length, max_tokens = op
            try:
                submit(lambda params: eng.submit(bases[base][:length], params), max_tokens)
            except RequestError:  # more than the 5 pages: refused up front, and the engine goes on
                assert eng.pages.first.pages_for(length + max_tokens) > 5
        elif kind == "step":
            for _ in range(op[1]):
                step(eng)
                check()
        elif kind == "fork" and pick(op[1]):
            try:
                submit(lambda params: eng.fork(pick(op[1]).request_id, params), op[2])
            except RequestError:
                pass  # not drained yet, or its history no longer fits the 5-page cache
        elif kind == "cancel" and pick(op[1]):
            pick(op[1]).cancel()
        elif kind == "finish" and pick(op[1]):
            target = pick(op[1])
            for _ in range(2000):
                if target.done:
                    break
                step(eng)
                check()
            assert target.done
        elif kind == "fault":
            fault.armed = op[1]
            step(eng)
            check()
            if fault.armed is None:
                event(f"fault in {op[1].value}")
            fault.armed = None
        elif kind == "shutdown":
            eng.shutdown()
            assert all(h.done for h in handles), "shutdown left a request waiting"
            break
        step(eng)  # the engine keeps running while requests come and go
        check()
    else:
        drain(eng, check=check)
        snap = eng.memory()
        assert snap.free_pages == snap.num_pages and not snap.ref_counts and snap.cpu_swapped == 0
    snap = eng.memory()
    for name, count in asdict(snap.counters).items():  # what the examples exercised (--hypothesis-show-statistics)
        if count and name in ("swap_outs", "recomputes", "cow_copies", "offloads", "cpu_hits", "evictions"):
            event(name)
    for handle in handles:
        done = handle.result(timeout=0)
        if done.finish_reason == "length":
            assert len(done.token_ids) == wanted[handle.request_id]
            if done.token_ids != isolated(done.prompt_token_ids, len(done.token_ids), kv):  # a near-tie at most
                expected = reference(ref, done.prompt_token_ids, len(done.token_ids))
                assert_same_greedy(ref, done.prompt_token_ids, done.token_ids, expected,
                                   near_tie=NEAR_TIE if kv == "float32" else NEAR_TIE_PACKED)
        elif done.finish_reason == "error":
            assert "RuntimeError: injected into" in done.error, done.error
        else:
            assert done.finish_reason == "cancelled"


def test_a_fork_refuses_a_grammar(tiny_llama):
    from pagedchat.engine.structured import GrammarSpec

    eng = manual(tiny_llama, kv_cache_memory="2MiB")
    parent = eng.submit(ids_of(eng.tokenizer, 20), SamplingParams(max_tokens=8, ignore_eos=True))
    step(eng)
    grammar = eng.compile_grammar(GrammarSpec.json_schema({"type": "object"}))
    with pytest.raises(RequestError, match="grammar"):
        eng.fork(parent.request_id, SamplingParams(max_tokens=4, grammar=grammar))
    drain(eng)
    assert len(parent.result().token_ids) == 8
