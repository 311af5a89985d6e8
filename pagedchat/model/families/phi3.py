"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, LongRoPE ("su") scaling, partial rotary (Phi-4-mini)."""

import math

from pagedchat.model.family import GGUF_LAYER, Family, Gguf, LayerWeights, uniform_layers

_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_extra(field, tensor) -> dict:
    """llama.cpp keeps LongRoPE's factors as two tensors, the rotated dims as rope.dimension_count (a head
    rotates only part of itself on Phi-4-mini), and the pretraining context in rope.scaling."""
    head_dim = int(field("embedding_length")) // int(field("attention.head_count"))
    rope = {"rope_type": "default", "rope_theta": float(field("rope.freq_base") or 10000.0),
            "partial_rotary_factor": int(field("rope.dimension_count") or head_dim) / head_dim}
    cfg = {"head_dim": head_dim, "rope_parameters": rope}
    long, short = (tensor(name) for name in _FACTORS)
    if long is not None and short is not None:
        original = int(field("rope.scaling.original_context_length"))
        rope.update(rope_type="longrope", long_factor=long, short_factor=short)
        cfg["original_max_position_embeddings"] = original
        scale = field("rope.scaling.attn_factor")
        if scale is not None and not math.isclose(scale, _default_attention_factor(field, original), rel_tol=1e-6):
            rope["attention_factor"] = float(scale)
    window = field("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    return cfg


def _default_attention_factor(field, original: int) -> float:
    factor = int(field("context_length")) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


_GGUF_LAYER = tuple(pair for pair in GGUF_LAYER if pair[0] not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
                    ) + (("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))

FAMILY = Family("Phi3ForCausalLM", "phi3", layers=uniform_layers,
                weights=LayerWeights(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
                gguf=Gguf("phi3", _GGUF_LAYER, extra=_gguf_extra, config_tensors=_FACTORS))
