"""Weight forms as typed values: what the packed-weights cache saves reads back as the same form, text no version
wrote is refused, and a model built from dense weights says so in its run paths."""

from __future__ import annotations

import pytest

from pagedchat import Engine
from pagedchat.model.forms import Dense, Int4Groups, Panels, Plain, Split, decode, encode, path
from tiny_models import make_tiny_model

FORMS = [Dense(), Plain(), Panels("Q4_K"), Int4Groups(True, "Q8_0"), Int4Groups(False, "Q4_1"), Split(3)]


@pytest.mark.parametrize("form", FORMS, ids=repr)
def test_a_form_reads_back_as_itself(form):
    assert decode(encode(form)) == form


@pytest.mark.parametrize("text", ["", "panels", "int4 2 Q8_0", "split x", "plain 1", "blocks Q4_K", "linear"])
def test_text_no_version_wrote_is_refused(text):
    with pytest.raises(ValueError, match="unknown weight form"):
        decode(text)


def test_each_form_names_its_kernel():
    assert path(Panels("Q6_K"), "pagedchat's AVX2 kernels", "float32") == "Q6_K panels on pagedchat's AVX2 kernels"
    assert "2×int4" in path(Int4Groups(True, "Q8_0"), "", "bfloat16")
    assert path(Plain(), "", "bfloat16, oneDNN packed") == "dense bfloat16, oneDNN packed on torch"


def test_a_dense_model_runs_every_projection_on_torch(tmp_path):
    engine = Engine(make_tiny_model(tmp_path / "tiny"), kv_cache_memory="2MiB", dtype="float32")
    try:
        paths = engine.model.run_paths()
        [line] = paths.projections
        count, name = line.split(" × ")
        layers = engine.config.num_layers
        assert name == "dense float32 on torch" and int(count) == 4 * layers + 1   # qkv, o, gate_up, down; head
        assert "norms, rotary and activation on torch" == paths.layers   # dense weights keep torch's ops
    finally:
        engine.shutdown()
