"""Tiny GGUF files written the way llama.cpp's converter writes them (its architecture and tensor names, its q/k
row order, Gemma's norms stored as 1 + w), from the tiny HF models of tiny_models.py of any family that has a
GGUF form: what the GGUF loading, quantized-weight and llama.cpp tests read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from tiny_models import config_of
from transformers import AutoTokenizer

from pagedchat.model import families
from pagedchat.model.family import GGUF_GLOBAL, GGUF_LAYER, NormStyle


QUANTIZED = ("blk.0.ffn_up.weight", "blk.1.attn_k.weight")  # one plain, one permuted: both pass through Q8_0


def gguf_name(hf_name: str, layer_names=GGUF_LAYER) -> str:
    """The GGUF name of a Hugging Face tensor, layer_names being a family's (GGUF piece, HF piece) pairs."""
    if hf_name.startswith("model.layers."):
        _, _, n, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{n}.{next(g for g, hf in layer_names if hf == module)}.{kind}"
    return {f"{hf}.weight": f"{g}.weight" for g, hf in GGUF_GLOBAL}[hf_name]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, copied so the test checks our inverse against it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tok = AutoTokenizer.from_pretrained(folder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control, 1 = normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)


def write_tiny_gguf(folder: Path, out: Path, *, quantized=QUANTIZED,
                    tokenizer: bool = True, qtype=gguf.GGMLQuantizationType.Q8_0, blocks=None) -> Path:
    """A GGUF of the tiny HF model in folder, laid out the way llama.cpp's converter writes it: the tensors
    named in quantized as qtype (or {"attn_v": type, "*": type}: by kind), by gguf's quantizer or, given, by
    blocks(name, array) -> raw blocks."""
    cfg = config_of(folder)
    family = families.of_config(cfg)
    weights = load_file(folder / "model.safetensors")
    w = gguf.GGUFWriter(out, family.gguf.arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters", {})
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' table; llama.cpp fixes the local one
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors as tensors, the pretraining context in rope.*
        original = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg["max_position_embeddings"] / original  # the converter's attention factor, always written
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        _add_tokenizer(w, folder)
    for name, t in weights.items():
        arr = t.float().numpy()
        gname = gguf_name(name, family.gguf.layer_names)
        if family.norm is NormStyle.UNIT_OFFSET and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma converter stores 1 + w
        if family.gguf.permuted_qk and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if ".attn_q." in gname else cfg["num_key_value_heads"]
            arr = llama_cpp_permute(arr, heads)
        if gname in quantized:
            kind = qtype.get(gname.split(".")[-2], qtype["*"]) if isinstance(qtype, dict) else qtype
            raw = blocks(gname, arr) if blocks else gguf.quants.quantize(arr, kind)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
