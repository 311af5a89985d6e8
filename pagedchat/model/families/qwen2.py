"""Qwen2 / Qwen2.5: Llama's recipe with q, k and v biases."""

from pagedchat.model.family import Family, Gguf, uniform_layers

FAMILY = Family("Qwen2ForCausalLM", "qwen2",
                layers=lambda cfg: uniform_layers(cfg, cfg.get("use_sliding_window", False)),
                gguf=Gguf("qwen2"), qkv_bias=lambda cfg: True)
