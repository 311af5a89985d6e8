import os
from pathlib import Path

# Triton decides interpreted-or-compiled when it is first imported, and torch or transformers may import
# it before any kernel test runs. Without a GPU the kernels can only run interpreted, so say so up front.
# The engine still takes the torch path on the CPU: it uses Triton on CUDA devices only, unless forced.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n auto`: a worker per core) each worker and the engine processes it starts take one
# thread: a second thread's barriers would spin against the other workers for the same cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import fcntl
from contextlib import ExitStack

import pytest
import torch

from pagedchat.model import qmm  # after TRITON_INTERPRET: it imports torch
from tiny_models import load_reference, make_tiny_model


@pytest.fixture(autouse=True, scope="session")
def _float32_by_default():
    """Engines built without a dtype run in fp32 here, whatever the CPU: the parity tests compare with
    transformers in fp32, and page budgets in the tests are counted in fp32 pages. bf16 is tested by name."""
    from pagedchat.engine import sizing

    real = sizing.cpu_has_native_bf16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sizing, "cpu_has_native_bf16", lambda: False)
        yield real  # for the test of the real one


@pytest.fixture(autouse=True, scope="session")
def _float32_pages_by_default():
    """Likewise engines built without a kv_cache_dtype keep float32 pages here (auto's are bf16): the parity
    tests compare bit for bit, and page budgets are counted in float32 pages. The others are tested by name."""
    from pagedchat.kernels import kv_pages

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_pages, "AUTO", torch.float32)
        yield


@pytest.fixture(autouse=True, scope="session")
def _no_user_config(tmp_path_factory):
    """The commands read config.toml: the developer's own (a model, a server) must not steer the tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _kernels_loaded():
    """pagedchat's kernels loaded (built first if this machine has none: `pagedchat pull` builds them in CI)
    before any engine starts: an engine in a test's own cache folder would otherwise compile them there."""
    qmm.ensure()


@pytest.fixture
def kernels():
    """kernels(name) runs this test's engines on that level of pagedchat's kernels (skipping where this CPU has
    none such), or kernels("off") on torch's paths: in float32 the weights dequantized exactly, transformers'
    tokens bit for bit."""
    before = os.environ.get(qmm.ENV)

    def use(name: str) -> None:
        if name != "off":
            why = qmm.ensure()
            if why is not None:
                pytest.skip(f"pagedchat's kernels are not built here: {why}")
            if name not in qmm.runnable():
                pytest.skip(f"this CPU does not run {name} (it runs {', '.join(qmm.runnable())})")
        qmm.use(name)

    yield use
    qmm.use(before)


@pytest.fixture(params=[lv.name for lv in qmm.levels_to_build()])
def each_level(request, kernels):
    """The test once per level of pagedchat's kernels, skipped where this CPU runs none such."""
    kernels(request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tie=True)


@pytest.fixture(scope="session")
def long_tiny_model(tmp_path_factory) -> Path:
    """A tiny model with room for replies of thousands of tokens, for tests that stop, fork or kill a reply
    mid-way: one of 400 tokens ends in a tenth of a second on a quiet machine. Seed 1 writes visible text."""
    return make_tiny_model(tmp_path_factory.mktemp("long-tiny"), seed=1, max_positions=4096)


@pytest.fixture(scope="session")
def tiny_llama_ref(tiny_llama):
    return load_reference(tiny_llama)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real SmolLM2 folder; CI pulls it before the tests (see .ci/run)."""
    from pagedchat.model.gguf import is_complete
    from pagedchat.model.pull import default_model_dir

    folder = default_model_dir()
    if not is_complete(folder):
        if os.environ.get("CI"):
            pytest.fail("the default model was not pulled: run `pagedchat pull` first")
        pytest.skip("the default model is not pulled (run `pagedchat pull`)")
    return folder


@pytest.fixture
def shared_prefix_reads(monkeypatch) -> list[int]:
    """Counts the decode attention calls that read the pages every chat shares once for all of them: the torch
    path's cascade, which this fixture makes the engines of the test run (the native kernel reads each
    sequence's pages where they lie, shared or not)."""
    from pagedchat.model import attention

    monkeypatch.setenv("PAGEDCHAT_ATTENTION", "torch")

    calls: list[int] = []
    read_once = attention._with_shared_prefix
    monkeypatch.setattr(attention, "_with_shared_prefix", lambda *a: calls.append(1) or read_once(*a))
    return calls


@pytest.fixture(autouse=True)
def _timing_tests_run_alone(request, tmp_path_factory):
    """Under xdist, a test marked `timing` (it compares a latency with one it measured a moment before, or with a
    fixed budget) runs while no other worker runs a test: each test holds a shared lock, a timing test the
    exclusive one. A turnstile taken first keeps the shared holders from starving the exclusive one."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    folder = tmp_path_factory.getbasetemp().parent   # the run's folder, shared by its workers
    alone = request.node.get_closest_marker("timing") is not None
    with ExitStack() as held:
        turnstile = held.enter_context(open(folder / "timing-turnstile.lock", "w"))
        tests = held.enter_context(open(folder / "timing-tests.lock", "w"))
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
