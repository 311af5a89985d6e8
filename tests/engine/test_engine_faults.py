"""The real engine under faults: one failing request never fails, hangs or corrupts another; an engine that
cannot go on says so to every request; shutdown ends every request; bad requests are refused at submit."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedchat import Engine, SamplingParams
from pagedchat.engine.core import Phase
from pagedchat.errors import RequestError

BATCH = [Phase.SCHEDULE, Phase.COPY, Phase.FORWARD, Phase.SAMPLE]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
A, B = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24]


class Once:
    """A fault hook that raises once, in `phase`, at its `at`-th call there (for one request if named)."""

    def __init__(self, phase: Phase, request_id: str | None = None, at: int = 1, error: type = RuntimeError):
        self.phase, self.request_id, self.left, self.error = phase, request_id, at, error
        self.fired = False

    def __call__(self, phase: Phase, request_id: str | None) -> None:
        if phase is self.phase and self.request_id in (None, request_id) and not self.fired:
            self.left -= 1
            if self.left == 0:
                self.fired = True
                raise self.error(f"boom in {phase.value}")


SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, seed=1234)


@pytest.fixture(scope="module")
def alone(tiny_llama) -> dict[tuple, list[int]]:
    """Each prompt's tokens run alone on a healthy engine: A and B greedy, and B seeded-sampled (key "B seeded")."""
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB")
    runs = {tuple(p): engine.generate([p], PARAMS)[0].token_ids for p in (A, B)}
    runs["B seeded"] = engine.generate([B], SEEDED)[0].token_ids
    engine.shutdown()
    return runs


def drain(engine: Engine) -> None:
    for _ in range(500):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine makes no progress")


def all_pages_free(engine: Engine) -> bool:
    snap = engine.memory()
    return snap.free_pages == snap.num_pages and not snap.ref_counts


@pytest.mark.parametrize("phase", BATCH)
def test_a_batch_phase_fault_fails_only_that_steps_requests(tiny_llama, alone, phase):
    """A runs and B waits (one sequence at a time): a fault in A's third step fails A with the phase and the
    error, frees its pages, and B then runs to the same tokens as alone. The engine goes on serving."""
    hook = Once(phase, at=3)
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", max_seqs=1, autostart=False, fault_hook=hook)
    a, b = engine.submit(A, PARAMS), engine.submit(B, PARAMS)
    drain(engine)
    assert hook.fired
    failed = a.result(timeout=0)
    assert failed.finish_reason == "error"
    assert failed.error == f"{phase.value} failed: RuntimeError: boom in {phase.value}"
    assert b.result(timeout=0).finish_reason == "length"
    assert b.result(timeout=0).token_ids == alone[tuple(B)]
    assert all_pages_free(engine)
    again = engine.submit(A, PARAMS)
    drain(engine)
    assert again.result(timeout=0).token_ids == alone[tuple(A)]


@pytest.mark.parametrize("phase", [Phase.SAMPLE, Phase.DETOKENIZE, Phase.BOOKKEEPING])
def test_a_fault_in_one_requests_phase_fails_that_request_only(tiny_llama, alone, phase):
    """A and B decode together; a fault in sampling A's row, detokenizing or bookkeeping A fails A alone."""
    hook = Once(phase, request_id="a", at=4)
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False, fault_hook=hook)
    a, b = engine.submit(A, PARAMS, request_id="a"), engine.submit(B, PARAMS, request_id="b")
    drain(engine)
    assert hook.fired
    assert a.result(timeout=0).finish_reason == "error" and f"boom in {phase.value}" in a.result(timeout=0).error
    assert b.result(timeout=0).token_ids == alone[tuple(B)]
    assert all_pages_free(engine)


def test_a_fault_after_the_batch_bookkeeping_keeps_what_it_finished(tiny_llama, alone):
    """A ends in the step whose batch bookkeeping then fails: A keeps its finished completion, and B, still
    running in that step, fails; nothing is left waiting."""
    engines = []

    def after_third_step(phase, request_id):
        if phase is Phase.BOOKKEEPING and request_id is None and engines[0].steps == 3:
            raise RuntimeError("late")

    engines.append(Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False, fault_hook=after_third_step))
    engine = engines[0]
    a = engine.submit(A, SamplingParams(max_tokens=3, ignore_eos=True))
    b = engine.submit(B, PARAMS)
    drain(engine)
    assert a.result(timeout=0).finish_reason == "length" and a.result().token_ids == alone[tuple(A)][:3]
    assert b.result(timeout=0).finish_reason == "error"
    assert b.result().error == "bookkeeping failed: RuntimeError: late"
    assert all_pages_free(engine)


def test_a_fault_on_the_engine_thread_ends_the_requests_instead_of_hanging_them(tiny_llama, alone):
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", fault_hook=Once(Phase.FORWARD, at=2))
    a, b = engine.generate([A, B], PARAMS)  # both in the faulted step
    assert (a.finish_reason, b.finish_reason) == ("error", "error")
    [ok] = engine.generate([B], PARAMS)
    assert ok.token_ids == alone[tuple(B)] and engine.failure is None
    engine.shutdown()


class Broken(BaseException):
    """Not an Exception: nothing in a step catches it, as with a loop that itself breaks."""


def test_an_engine_that_cannot_go_on_ends_every_request_and_says_why(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", fault_hook=Once(Phase.SAMPLE, at=3, error=Broken))
    running = engine.submit(A, SamplingParams(max_tokens=100, ignore_eos=True))
    done = running.result(timeout=30)
    assert done.finish_reason == "error" and done.error == "engine stopped: Broken: boom in sampling"
    assert list(running)[-1].finished  # iterating the handle ends
    assert engine.failure == "Broken: boom in sampling"
    with pytest.raises(RequestError, match="^engine stopped: Broken: boom in sampling$"):
        engine.submit(B, PARAMS)
    engine.shutdown()


def test_faults_no_request_explains_stop_the_engine(tiny_llama):
    """Page copies fail on every step, with nothing to blame: after three in a row the engine stops."""

    def always(phase, request_id):
        if phase is Phase.COPY:
            raise OSError("device lost")

    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False, fault_hook=always)
    for _ in range(3):
        engine.step()
    assert engine.failure == "page copies failed 3 times in a row (OSError: device lost)"
    with pytest.raises(RequestError, match="engine stopped: page copies failed"):
        engine.submit(A, PARAMS)


def test_blameless_faults_with_progress_between_them_do_not_stop_the_engine(tiny_llama):
    idle = {"fail": True}

    def on_idle_copies(phase, request_id):
        if phase is Phase.COPY and idle["fail"]:
            raise OSError("flaky")

    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False, fault_hook=on_idle_copies)
    for _ in range(2):
        engine.step()
    idle["fail"] = False
    done = engine.submit(A, PARAMS)
    drain(engine)
    idle["fail"] = True
    for _ in range(2):
        engine.step()
    assert engine.failure is None and done.result(timeout=0).finish_reason == "length"
    engine.step()
    assert engine.failure == "page copies failed 3 times in a row (OSError: flaky)"


@pytest.mark.timing   # a second of wall clock: another worker's load must not eat it
def test_shutdown_ends_running_and_queued_requests_within_a_second(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", max_seqs=1)
    running = engine.submit(A, SamplingParams(max_tokens=400, ignore_eos=True))
    queued = engine.submit(B, SamplingParams(max_tokens=400, ignore_eos=True))
    first = next(iter(running))  # it streams
    streamed: list = []
    reader = threading.Thread(target=lambda: streamed.extend(running))
    reader.start()
    start = time.monotonic()
    engine.shutdown()
    for handle in (running, queued):
        assert handle.result(timeout=1).finish_reason == "cancelled"
    assert time.monotonic() - start < 1
    reader.join(timeout=1)
    assert not reader.is_alive() and streamed[-1].finished, "iterating a handle ends at shutdown"
    assert first.text + "".join(d.text for d in streamed) == running.result().text
    with pytest.raises(RequestError, match="shut down"):
        engine.submit(A, PARAMS)


def test_a_shutdown_between_a_step_and_its_delivery_loses_no_text(tiny_llama):
    """A step hands its updates over after it lets go of the engine's lock; a shutdown that comes between ends
    the request, and its final update carries that step's text and tokens, which its own update then cannot."""
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False)
    handle = engine.submit(A, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    pending = engine._compute.call(engine.core.run_step, engine._model, engine._lock)  # stepped, not delivered
    assert pending and not pending[0][1].finished and pending[0][1].tokens == 1
    engine.shutdown()
    engine._deliver(pending)  # too late: the request has ended
    updates = list(handle)
    outcome = handle.result(timeout=0)
    assert outcome.finish_reason == "cancelled" and len(outcome.token_ids) == 4
    assert "".join(u.text for u in updates) == outcome.text
    assert sum(u.tokens for u in updates) == 4 and [t for u in updates for t in u.token_ids] == outcome.token_ids


def test_shutdown_ends_a_request_that_never_left_the_inbox(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False)
    handle = engine.submit(A, PARAMS)
    engine.shutdown()
    done = handle.result(timeout=1)
    assert done.finish_reason == "cancelled" and done.token_ids == [] and done.prompt_token_ids == A


def test_a_request_id_in_use_is_refused_at_submit(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False)
    first = engine.submit(A, PARAMS, request_id="x")  # still in the inbox
    with pytest.raises(RequestError, match="request id 'x' is already in use"):
        engine.submit(B, PARAMS, request_id="x")
    with pytest.raises(RequestError, match="request id 'y' is already in use"):
        engine.submit_many([A, B], PARAMS, request_ids=["y", "y"])
    engine.step()  # now running
    with pytest.raises(RequestError, match="already in use"):
        engine.submit(B, PARAMS, request_id="x")
    drain(engine)
    assert first.result(timeout=0).finish_reason == "length"
    again = engine.submit(B, PARAMS, request_id="x")  # a finished request's id may be used again
    drain(engine)
    assert again.result(timeout=0).finish_reason == "length"


def test_a_reply_that_fills_the_context_ends_as_context_full(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", autostart=False)
    ctx = engine.config.max_position_embeddings
    full = engine.submit([5] * (ctx - 3), SamplingParams(max_tokens=10, ignore_eos=True))
    capped = engine.submit([5] * (ctx - 3), SamplingParams(max_tokens=2, ignore_eos=True))
    drain(engine)
    assert full.result(timeout=0).finish_reason == "context_full" and len(full.result().token_ids) == 3
    assert capped.result(timeout=0).finish_reason == "length"


@pytest.mark.parametrize("fields,message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=1e-40), "temperature must be 0 \\(greedy\\) or at least 0.01"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(top_p=float("nan")), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_k=1.5), "top_k must be a whole number"),
    (dict(max_tokens=float("inf")), "max_tokens must be a whole number"),
    (dict(max_tokens=0), "max_tokens must be a whole number of at least 1"),
    (dict(max_tokens=True), "max_tokens must be a whole number"),
    (dict(seed=1.5), "seed must be a whole number"),
    (dict(seed=2**64), "seed must be a whole number that fits in 64 bits"),
    (dict(seed=-2**63 - 1), "seed must be a whole number that fits in 64 bits"),
    (dict(stop=[""]), "stop strings must be non-empty text"),
])
def test_sampling_params_refuse_what_cannot_be_sampled(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_sampling_params_accept_the_edges():
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(temperature=2, top_p=1, top_k=0, max_tokens=1, seed=0).temperature == 2
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-2**63).seed == -2**63


# Settings a client may send that sit at the edges of what float32 holds: a top_p that rounds to 0 or to 1, a
# temperature from the floor to beyond float32's largest number, a top_k larger than any vocabulary, any seed.
HOSTILE = st.builds(
    SamplingParams, max_tokens=st.integers(1, 12), ignore_eos=st.booleans(),
    temperature=st.one_of(st.just(0.0), st.floats(0.01, 1e308), st.sampled_from([0.01, 3.5e38, 1e308])),
    top_p=st.one_of(st.floats(5e-324, 1.0, exclude_min=False), st.sampled_from([5e-324, 7e-46, 1e-38, 1 - 1e-9])),
    top_k=st.one_of(st.integers(0, 300), st.just(2**70)),
    seed=st.one_of(st.none(), st.integers(-2**63, 2**64 - 1)))


@pytest.fixture(scope="module")
def shared_engine(tiny_llama):
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", autostart=False)
    yield engine
    engine.shutdown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hostile=st.lists(st.tuples(HOSTILE, st.lists(st.integers(1, 255), min_size=1, max_size=40)),
                        min_size=1, max_size=4))
def test_hostile_sampling_settings_never_change_or_fail_an_innocent_request(shared_engine, alone, hostile):
    """Hostile requests run in the same steps as a greedy and a seeded innocent one: each hostile one ends on
    its own terms, and the innocent ones finish with the tokens they have alone."""
    engine = shared_engine
    greedy, seeded = engine.submit(A, PARAMS), engine.submit(B, SEEDED)
    others = [engine.submit(prompt, params) for params, prompt in hostile]
    drain(engine)
    assert greedy.result(timeout=0).token_ids == alone[tuple(A)]
    assert seeded.result(timeout=0).token_ids == alone["B seeded"]
    for handle in others:
        assert handle.result(timeout=0).finish_reason in ("stop", "length"), handle.result().error
    assert all_pages_free(engine)



def test_a_cancel_during_a_long_prefill_frees_its_pages_before_the_next_chunk(tiny_llama):
    """A 300-token prompt prefills in chunks of 64 tokens, one a step. Cancelled after its first chunk, it ends
    at the next step, before any other chunk is computed, and its pages are free."""
    engine = Engine(str(tiny_llama), kv_cache_memory="2MiB", max_tokens_per_step=64, autostart=False)
    handle = engine.submit(list(range(5, 305)), PARAMS)
    engine.step()
    assert engine.memory().seqs[handle.request_id].num_computed == 64
    handle.cancel()
    steps = engine.steps
    engine.step()
    done = handle.result(timeout=0)
    assert done.finish_reason == "cancelled" and done.token_ids == []
    assert engine.steps == steps, "no chunk was computed after the cancel"
    assert all_pages_free(engine) and not engine.has_work()
