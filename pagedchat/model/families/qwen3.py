"""Qwen3 (dense): Llama's recipe with an RMS norm over each head's q and k before rotary, and no biases."""

from pagedchat.model.family import GGUF_LAYER, Family, Gguf, LayerWeights, uniform_layers

FAMILY = Family(
    "Qwen3ForCausalLM", "qwen3",
    layers=lambda cfg: uniform_layers(cfg, cfg.get("use_sliding_window", False)),
    weights=LayerWeights(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    gguf=Gguf("qwen3", GGUF_LAYER + (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"))))
