import os
from pathlib import Path

# Triton decides interpreted-or-compiled when it is first imported, and torch or transformers may import
# it before any kernel test runs. Without a GPU the kernels can only run interpreted, so say so up front.
# The engine still takes the torch path on the CPU: it uses Triton on CUDA devices only, unless forced.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tiny_models import load_reference, make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tie=True)


@pytest.fixture(scope="session")
def tiny_llama_ref(tiny_llama):
    return load_reference(tiny_llama)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real SmolLM2 folder; CI pulls it before the tests (see .ci/run)."""
    from pagedchat.model.loader import is_complete
    from pagedchat.model.pull import default_model_dir

    folder = default_model_dir()
    if not is_complete(folder):
        if os.environ.get("CI"):
            pytest.fail("the default model was not pulled: run `pagedchat pull` first")
        pytest.skip("the default model is not pulled (run `pagedchat pull`)")
    return folder
