"""Gemma 3 (text): five sliding-window layers to one global layer, each kind with its own rotary base; q/k
norms; norms on both sides of attention and of the MLP, all scaling by (1 + w); GELU-tanh; embeddings scaled by
sqrt(hidden); attention scaled by query_pre_attn_scalar; no system role in its chat template."""

from pagedchat.model.family import (GGUF_LAYER, Activation, Family, Gguf, LayerSpec, LayerWeights, NormStyle, Rope,
                                    layer_windows)

_FULL, _SLIDING = "full_attention", "sliding_attention"


def _layer_types(cfg: dict) -> list[str]:
    pattern = cfg.get("sliding_window_pattern", 6)
    return cfg.get("layer_types") or [_SLIDING if (i + 1) % pattern else _FULL
                                      for i in range(cfg["num_hidden_layers"])]


def _layers(cfg: dict) -> tuple[LayerSpec, ...]:
    nested = cfg.get("rope_parameters") or {}
    # transformers 5 nests a table per layer kind; older configs give rope_theta, rope_local_base_freq and a
    # rope_scaling for the global layers.
    full = dict(nested.get(_FULL) or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    local = dict(nested.get(_SLIDING) or {"rope_type": "default",
                                          "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)})
    positions = cfg.get("max_position_embeddings", 131072)
    ropes = {_FULL: Rope.from_params(full, 1_000_000.0, positions),
             _SLIDING: Rope.from_params(local, 10_000.0, positions)}
    types = _layer_types(cfg)
    windows = layer_windows({**cfg, "layer_types": types})
    return tuple(LayerSpec(ropes[kind], window) for kind, window in zip(types, windows))


def _refuse(cfg: dict) -> str | None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            return f"{key} is set, which pagedchat does not implement"
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        return f"activation {cfg['hidden_activation']!r} (pagedchat runs gelu_pytorch_tanh)"
    return None


def _gguf_extra(field, tensor) -> dict:
    """llama.cpp keeps the global layers' base and scaling in rope.*, and fixes the local base at 10000 and
    the query scale at 1/sqrt(head_dim) (all but 27B's)."""
    full = {"rope_type": "default", "rope_theta": float(field("rope.freq_base") or 1_000_000.0)}
    if (field("rope.scaling.type") or "none") == "linear":
        full.update(rope_type="linear", factor=float(field("rope.scaling.factor")))
    return {"sliding_window": int(field("attention.sliding_window")),
            "query_pre_attn_scalar": int(field("attention.key_length")),
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {_FULL: full, _SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}}}


_GGUF_LAYER = tuple(pair for pair in GGUF_LAYER if pair[0] != "ffn_norm") + (
    ("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"), ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"))

FAMILY = Family(
    "Gemma3ForCausalLM", "gemma3_text", layers=_layers,
    weights=LayerWeights(attn_out_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                         mlp_out_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm",
                         k_norm="self_attn.k_norm"),
    # llama.cpp's converter stores Gemma's norm weights as 1 + w (see NormStyle.UNIT_OFFSET).
    gguf=Gguf("gemma3", _GGUF_LAYER, extra=_gguf_extra),
    activation=Activation.GELU_TANH, norm=NormStyle.UNIT_OFFSET, embed_scale=True,
    attention_scale=lambda cfg: cfg.get("query_pre_attn_scalar", 256) ** -0.5,
    system_role=False, refuse=_refuse)
