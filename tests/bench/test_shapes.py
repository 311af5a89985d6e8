"""`pagedchat bench --write-shape`: the shaped files of random weights load in pagedchat and generate; llama.cpp
quantizes them where it is installed. Tiny shapes: the named ones take minutes and gigabytes."""

from __future__ import annotations

import importlib.util

import gguf
import pytest
from tiny_gguf import write_tiny_gguf

from pagedchat import Engine, SamplingParams
from pagedchat.bench import shapes
from pagedchat.bench.command import run_write_shape

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tokenizer_gguf(tiny_llama, tmp_path_factory):
    return write_tiny_gguf(tiny_llama, tmp_path_factory.mktemp("tok") / "tok.gguf")


def _generate(path) -> list[int]:
    engine = Engine(str(path), dtype="float32", kv_cache_memory="8MiB", autostart=False)
    try:
        handle = engine.submit("Hello there", SamplingParams(max_tokens=4))
        while engine.has_work():
            engine.step()
        return handle.result().token_ids
    finally:
        engine.shutdown()


def test_the_f16_file_names_its_tensors_as_llama_cpp_and_generates(tokenizer_gguf, tmp_path):
    shape = shapes.Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    path = shapes.write_f16(shape, tmp_path / "s.gguf", tokenizer_gguf)
    reader = gguf.GGUFReader(path)
    source = gguf.GGUFReader(tokenizer_gguf)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    assert reader.fields["tokenizer.ggml.tokens"].contents() == source.fields["tokenizer.ggml.tokens"].contents()
    tensors = {t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    assert tensors["blk.1.attn_k.weight"] == (gguf.GGMLQuantizationType.F16, (2 * 16, 64))
    assert tensors["blk.0.ffn_down.weight"] == (gguf.GGMLQuantizationType.F16, (64, 128))
    assert tensors["token_embd.weight"][1] == (vocab, 64) and "output.weight" not in tensors  # tied
    assert reader.fields["llama.block_count"].contents() == 2
    assert len(_generate(path)) == 4


def test_an_unknown_shape_or_a_name_without_gguf_is_refused(capsys, tmp_path):
    assert run_write_shape("llama-70b", str(tmp_path / "x.gguf")) == 2
    assert "llama-1b, llama-3b" in capsys.readouterr().err
    assert run_write_shape("llama-1b", str(tmp_path / "x.bin")) == 2
    assert ".gguf" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed")
def test_llama_cpp_quantizes_the_shape_to_q4_k_m(tokenizer_gguf, tmp_path):
    shape = shapes.Shape(hidden=256, layers=1, heads=4, kv_heads=2, ffn=512)
    out = shapes.quantize_q4_k_m(shapes.write_f16(shape, tmp_path / "s.f16.gguf", tokenizer_gguf),
                                 tmp_path / "s.gguf")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert len(_generate(out)) == 4


@pytest.mark.skipif(HAS_LLAMA_CPP, reason="llama-cpp-python is installed")
def test_without_llama_cpp_the_f16_file_is_kept_and_the_message_says_why(tokenizer_gguf, tmp_path):
    f16 = shapes.write_f16(shapes.Shape(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128), tmp_path / "a.gguf",
                           tokenizer_gguf)
    with pytest.raises(shapes.BenchError, match="llama-cpp-python is not installed"):
        shapes.quantize_q4_k_m(f16, tmp_path / "b.gguf")
    assert f16.exists()
