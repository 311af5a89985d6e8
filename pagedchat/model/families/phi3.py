"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, LongRoPE ("su") scaling, partial rotary (Phi-4-mini)."""

from pagedchat.model.family import Family, LayerWeights, uniform_layers

FAMILY = Family("Phi3ForCausalLM", "phi3", layers=uniform_layers,
                weights=LayerWeights(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)))
