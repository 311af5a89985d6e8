"""Model resolution, GGUF conversion and weight loading, all offline on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_reference import transformers_from_gguf
from safetensors.torch import load_file, save_file
from tiny_gguf import QUANTIZED, gguf_name, llama_cpp_permute, write_tiny_gguf
from tiny_models import config_of, make_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedchat.errors import ModelError
from pagedchat.model import gguf as gguf_model
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.gguf import convert_gguf
from pagedchat.model.loader import eos_token_ids, load_tokenizer, load_weights, resolve_model

SAMPLE = "The quick brown fox says hello world, 12345 times.\n"


def q8_roundtrip(w: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)


def _reference(folder: Path):
    """The original model with the Q8_0 tensors replaced by their quantize/dequantize round trip."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if gguf_name(name) in QUANTIZED:
                p.copy_(torch.from_numpy(q8_roundtrip(p.numpy())))
    return model


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True)])
def test_gguf_round_trip_matches_original_logits(tmp_path, arch, tie):
    """The folder holds the config and tokenizer, no weights; its weights, read from the GGUF and dequantized
    in float32, are the original's (Q8_0 ones as quantized) element for element, and give its logits."""
    src = make_tiny_model(tmp_path / "src", arch, tie=tie)
    gguf_path = write_tiny_gguf(src, tmp_path / "tiny.gguf")
    progress = []
    out = convert_gguf(gguf_path, tmp_path / "out", lambda m, f: progress.append((m, f)))

    original = ModelConfig.from_folder(src)
    converted = ModelConfig.from_folder(out)
    assert converted == original
    assert config_of(out)["tie_word_embeddings"] is tie
    assert not list(out.glob("*.safetensors")) and gguf_model.gguf_weights(out) == gguf_path.resolve()

    reference = _reference(src)
    want = reference.state_dict()
    got = load_weights(out, torch.float32, "cpu")
    assert set(got) == set(want) - ({"lm_head.weight"} if tie else set())
    for name, tensor in got.items():
        assert torch.equal(tensor.dense(torch.float32), want[name]), name

    ids = torch.tensor([list(range(1, 40))])
    with torch.no_grad():
        want_logits = reference(ids).logits
        got_logits = transformers_from_gguf(out)(ids).logits
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)

    fractions = [f for m, f in progress if f is not None]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_gguf_tokenizer_and_chat_template_survive(tmp_path):
    src = make_tiny_model(tmp_path / "src")
    out = convert_gguf(write_tiny_gguf(src, tmp_path / "tiny.gguf"), tmp_path / "out")
    want, got = AutoTokenizer.from_pretrained(src), load_tokenizer(out)
    assert got.encode(SAMPLE) == want.encode(SAMPLE)
    assert got.decode([got.eos_token_id]) == want.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": "hi there"}]
    assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert eos_token_ids(out, ModelConfig.from_folder(out).eos_token_ids, got) == (want.eos_token_id,)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    assert np.array_equal(gguf_model._unpermute_qk(llama_cpp_permute(w, 6), 6), w)
    b = np.arange(6 * 8, dtype=np.float32)
    assert np.array_equal(gguf_model._unpermute_qk(llama_cpp_permute(b, 6), 6), b)


def _gguf_with_arch(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'"):
        convert_gguf(_gguf_with_arch(tmp_path / "x.gguf", "gpt2"), tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.999, 10])
def test_truncated_gguf_is_a_model_error(tmp_path, keep):
    src = make_tiny_model(tmp_path / "src")
    path = write_tiny_gguf(src, tmp_path / "tiny.gguf", tokenizer=False)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ModelError) as err:
        convert_gguf(path, tmp_path / "out")
    assert "\n" not in str(err.value) and "tiny.gguf" in str(err.value)


def test_not_a_gguf_is_a_model_error(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelError, match="junk.gguf"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors_is_a_model_error(tmp_path, damage):
    folder = make_tiny_model(tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(ModelError, match="model.safetensors") as err:
        load_weights(folder, torch.float32, "cpu")
    assert "\n" not in str(err.value)


def test_load_weights_single_and_sharded(tmp_path):
    folder = make_tiny_model(tmp_path / "m", tie=False)
    single = load_weights(folder, torch.bfloat16, "cpu")
    original = load_file(folder / "model.safetensors")
    assert single.keys() == original.keys() and "lm_head.weight" in single
    assert all(t.dtype == torch.bfloat16 for t in single.values())

    names = sorted(original)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: original[k] for k in keys}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_weights(folder, torch.float32, "cpu")
    assert sharded.keys() == original.keys()
    assert all(torch.equal(sharded[k], original[k]) for k in names)

    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        load_weights(folder, torch.float32, "cpu")


def test_folder_without_weights_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no model.safetensors"):
        load_weights(tmp_path, torch.float32, "cpu")


def test_resolve_missing_path(tmp_path):
    with pytest.raises(ModelError, match="no such model: .*give a model folder, a .gguf file, or a hub id"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="no such model"):
        resolve_model(tmp_path / "missing.gguf")


def test_resolve_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="not a Hugging Face model folder"):
        resolve_model(tmp_path)


def test_resolve_folder_is_returned_as_is(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    assert resolve_model(folder) == folder
    assert resolve_model(str(folder)) == folder


def test_resolve_gguf_converts_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    src = make_tiny_model(tmp_path / "src")
    path = write_tiny_gguf(src, tmp_path / "tiny.gguf")
    first = resolve_model(path)
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-")
    assert gguf_model.is_complete(first) and ModelConfig.from_folder(first) == ModelConfig.from_folder(src)
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary folders left behind

    def boom(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_model, "convert_gguf", boom)
    assert resolve_model(str(path)) == first

    moved = path.rename(tmp_path / "moved.gguf")  # the same file elsewhere: read where it is now
    assert resolve_model(moved) == first and gguf_model.gguf_weights(first) == moved.resolve()


def test_resolve_gguf_replaces_an_old_float32_conversion(tmp_path, monkeypatch):
    """A folder an older pagedchat converted (float32 safetensors, no GGUF pointer) is converted again."""
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    src = make_tiny_model(tmp_path / "src")
    path = write_tiny_gguf(src, tmp_path / "tiny.gguf")
    old = tmp_path / "cache" / "models" / f"gguf-{gguf_model.gguf_fingerprint(path)}"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"old float32 weights")
    (old / gguf_model.COMPLETE_MARKER).write_text("ok\n")
    assert resolve_model(path) == old
    assert not (old / "model.safetensors").exists() and gguf_model.gguf_weights(old) == path.resolve()


def test_failed_gguf_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="gpt2"):
        resolve_model(_gguf_with_arch(tmp_path / "x.gguf", "gpt2"))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_hub_download_failure_is_a_model_error(monkeypatch):
    import huggingface_hub

    def fail(repo_id, **kwargs):
        assert "*.safetensors" in kwargs["allow_patterns"]
        raise OSError("connection refused\nmore details")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ModelError, match=r"^could not download someorg/some-model from the Hugging Face hub: "
                                         r"connection refused$"):
        resolve_model("someorg/some-model")


def test_hub_download_returns_the_snapshot(tmp_path, monkeypatch):
    import huggingface_hub

    folder = make_tiny_model(tmp_path / "snap")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(folder))
    assert resolve_model("someorg/some-model") == folder


def test_load_tokenizer_failure_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelError, match="could not load its tokenizer"):
        load_tokenizer(tmp_path)


def test_eos_token_ids_union(tmp_path):
    class Tok:
        eos_token_id = 7

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert eos_token_ids(tmp_path, (6, 9), Tok()) == (5, 6, 9, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids(tmp_path, (), Tok()) == (9, 7)
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(tmp_path, (3,), None) == (3,)
