"""Model-shaped GGUF files of random weights, for measuring at the sizes people run (`pagedchat bench
--write-shape`): a named Llama shape, the default model's tokenizer, random F16 weights, then Q4_K_M by
llama.cpp's own quantizer where llama-cpp-python is installed. Speed does not depend on the weights' values, so
such a file times like the real model of its shape without downloading one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedchat.bench.options import BenchError

ARCH = "llama"
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
        """Each tensor's llama.cpp name and torch-order shape [rows, inputs]: the embedding tied to the head, as
        Llama 3.2's small models have it."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("token_embd.weight", (vocab, h))]
        for i in range(self.layers):
            out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                    (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                    (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.ffn_gate.weight", (self.ffn, h)), (f"blk.{i}.ffn_up.weight", (self.ffn, h)),
                    (f"blk.{i}.ffn_down.weight", (h, self.ffn))]
        return out + [("output_norm.weight", (h,))]


SHAPES = {
    "llama-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),  # Llama 3.2 1B's
    "llama-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),  # Llama 3.2 3B's
}


def shape_named(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise BenchError(f"no shape {name!r}: the shapes are {', '.join(SHAPES)}") from None


def default_tokenizer_gguf() -> Path:
    """The pulled default model's GGUF, whose tokenizer the shapes take."""
    from pagedchat.model.pull import default_model_dir

    found = sorted(default_model_dir().glob("*.gguf"))
    if not found:
        raise BenchError(f"the default model is not pulled (no .gguf in {default_model_dir()}): run `pagedchat "
                         "pull` first; the shapes take its tokenizer")
    return found[0]


def _copy_tokenizer(writer, source: Path) -> int:
    """The tokenizer.* fields of source's GGUF into writer, as they are; returns the vocabulary's size."""
    import gguf

    reader = gguf.GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise BenchError(f"{source} holds no tokenizer (tokenizer.ggml.tokens)")
    return vocab


def write_f16(shape: Shape, out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """A GGUF of shape with tokenizer's tokenizer: random F16 matrices (std 0.02) and norms of ones, streamed to
    out tensor by tensor, so the whole model is never in memory at once."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, ARCH)
    writer.add_name(f"random {shape.layers}-layer llama shape")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _copy_tokenizer(writer, tokenizer)
    tensors = shape.tensors(vocab)
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, dims in tensors:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, np.float32) * 0.02).astype(np.float16))
    writer.close()
    return out


def quantize_q4_k_m(f16: Path, out: Path) -> Path:
    """f16 turned into Q4_K_M by llama.cpp's own quantizer (llama-cpp-python's binding of it)."""
    try:
        import llama_cpp
    except ImportError:
        raise BenchError(f"llama-cpp-python is not installed, so the F16 file {f16} was not quantized: "
                         "`pip install llama-cpp-python` and write the shape again, or run the F16 file "
                         "as it is") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
    if status != 0:
        raise BenchError(f"llama.cpp's quantizer failed on {f16} (status {status})")
    return out


def write_shape(name: str, out: Path, tokenizer: Path | None = None, progress=print) -> Path:
    """`--write-shape NAME FILE`: shape name's Q4_K_M file at out, its F16 source written beside it first and
    removed once quantized (kept, with a message, where llama-cpp-python is missing)."""
    shape = shape_named(name)
    out = Path(out)
    if out.suffix != ".gguf":
        raise BenchError(f"{out}: the shape's file must end in .gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(out.stem + ".f16.gguf")
    progress(f"writing {name} (hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads, "
             f"{shape.kv_heads} KV heads, FFN {shape.ffn}) in F16 to {f16}")
    write_f16(shape, f16, tokenizer or default_tokenizer_gguf())
    progress(f"quantizing to Q4_K_M with llama.cpp into {out}")
    quantize_q4_k_m(f16, out)
    f16.unlink()
    return out
