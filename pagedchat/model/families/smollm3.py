"""SmolLM3: Llama's recipe, with no rotary at all in every fourth layer (NoPE)."""

from pagedchat.model.family import Family, Gguf, LayerSpec, base_rope, layer_windows


def _layers(cfg: dict) -> tuple[LayerSpec, ...]:
    n = cfg["num_hidden_layers"]
    # no_rope_layers[i] is 1 where layer i rotates; configs may give only the interval.
    interval = cfg.get("no_rope_layer_interval", 4)
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    rope = base_rope(cfg)
    windows = layer_windows(cfg, cfg.get("use_sliding_window", False))
    return tuple(LayerSpec(rope if uses else None, w) for uses, w in zip(uses_rope, windows))


# llama.cpp writes it with its Llama converter (q/k rows permuted) and a fixed NoPE interval of 4.
FAMILY = Family("SmolLM3ForCausalLM", "smollm3", layers=_layers, gguf=Gguf("smollm3", permuted_qk=True))
