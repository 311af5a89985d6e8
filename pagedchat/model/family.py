"""What a model family is made of: the parts a family module (pagedchat/model/families/) declares.

A family says how to read its config.json (its layers: rotary tables and sliding windows per layer), what its
weights are called in Hugging Face checkpoints and in GGUF files, how a decoder layer is put together (norm
placement and style, activation, q/k norms, embedding scale) and what its chat template cannot do. The model,
the loader, the packer and the GGUF reader read these declarations: none of them names an architecture.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from pagedchat.errors import ModelError


class Activation(Enum):
    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


class NormStyle(Enum):
    """LLAMA: normalise in float32, round to the model's dtype, then scale by w (transformers' LlamaRMSNorm).
    UNIT_OFFSET: scale by (1 + w) in float32, then round (Gemma's RMSNorm)."""

    LLAMA = "llama"
    UNIT_OFFSET = "unit_offset"


class RopeKind(Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    LONGROPE = "longrope"


@dataclass(frozen=True)
class Rope:
    """One rotary table: transformers' rope_parameters for a layer, typed. Fields a kind does not use stay None."""

    kind: RopeKind
    theta: float
    partial: float = 1.0                      # fraction of head_dim that rotates (Phi-4-mini: 0.75)
    factor: float | None = None
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0              # llama3
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0                   # yarn
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None     # yarn, longrope: scales cos and sin
    short_factor: tuple[float, ...] = ()      # longrope
    long_factor: tuple[float, ...] = ()

    @classmethod
    def from_params(cls, params: dict, theta: float, max_positions: int) -> "Rope":
        """From a rope_parameters (or legacy rope_scaling) dict; theta where it names none."""
        name = params.get("rope_type", params.get("type", "default"))
        if name == "su":  # Phi-3's first checkpoints call longrope this
            name = "longrope"
        try:
            kind = RopeKind(name)
        except ValueError:
            raise ModelError(f"unsupported rope scaling {name!r}: pagedchat implements "
                             f"{', '.join(k.value for k in RopeKind)}") from None
        factor = params.get("factor")
        return cls(
            kind=kind, theta=float(params.get("rope_theta", theta)),
            partial=float(params.get("partial_rotary_factor", 1.0)),
            factor=None if factor is None else float(factor),
            original_max_positions=params.get("original_max_position_embeddings", max_positions),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)), attention_factor=params.get("attention_factor"),
            short_factor=_float32s(params.get("short_factor")), long_factor=_float32s(params.get("long_factor")))

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial)

    def inv_freq(self, head_dim: int, max_positions: int, long: bool = False) -> tuple[torch.Tensor, float]:
        """(inverse frequencies, cos/sin scale), as transformers' rope init function of this kind computes them.
        long: longrope's long factors (positions past the original context), else its short ones."""
        dim = self.rotary_dim(head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        base = 1.0 / (self.theta ** exponents)
        return _INV_FREQ[self.kind](self, base, exponents, dim, max_positions, long)


def _float32s(values) -> tuple[float, ...]:
    """Factors as the float32 numbers the rotary math uses: a config's 1.2000000000000002 and a GGUF's
    1.2000000476837158 are the same factor."""
    return tuple(torch.tensor(values or [], dtype=torch.float32).tolist())


def _default(rope: Rope, base, exponents, dim, max_positions, long):
    return base, 1.0


def _linear(rope: Rope, base, exponents, dim, max_positions, long):
    return base / rope.factor, 1.0


def _llama3(rope: Rope, inv_freq, exponents, dim, max_positions, long):
    # Llama 3.1's rule: stretch low frequencies by `factor`, keep high ones, blend the band between.
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_positions
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: Rope, base, exponents, dim, max_positions, long):
    """YaRN: interpolate low frequencies, extrapolate high ones, a linear ramp between (in dimension space)."""
    old_len = rope.original_max_positions
    factor = rope.factor if rope.factor is not None else max_positions / old_len
    scale = rope.attention_factor
    if scale is None:
        scale = (_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
                 if rope.mscale and rope.mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(scale)


def _longrope(rope: Rope, base, exponents, dim, max_positions, long):
    """LongRoPE (Phi-3's "su"): per-frequency factors, short within the original context, long past it."""
    old_len = rope.original_max_positions
    factor = rope.factor if rope.factor is not None else max_positions / old_len
    scale = rope.attention_factor
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    return 1.0 / (ext * rope.theta ** exponents), float(scale)


_INV_FREQ: dict[RopeKind, Callable] = {RopeKind.DEFAULT: _default, RopeKind.LINEAR: _linear,
                                       RopeKind.LLAMA3: _llama3, RopeKind.YARN: _yarn, RopeKind.LONGROPE: _longrope}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention: its rotary table (None: no rotary, SmolLM3's NoPE layers) and its sliding
    window in tokens (None: global attention)."""

    rope: Rope | None
    window: int | None = None


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose KV pages come and go together (engine/page_groups.py): the global layers, or the layers of
    one window size, which release the pages their window has passed (window None: they keep every page)."""

    window: int | None
    layers: tuple[int, ...]


def layer_groups(layers: tuple[LayerSpec, ...], release: bool = True) -> tuple[LayerGroup, ...]:
    """The global layers first (where there are any), then one group per window size, smallest first. Without
    release (or without windows) every layer is in one group that keeps its pages, as a contiguous cache would."""
    if not release:
        return (LayerGroup(None, tuple(range(len(layers)))),)
    windows = sorted({spec.window for spec in layers}, key=lambda w: -1 if w is None else w)
    return tuple(LayerGroup(w, tuple(i for i, spec in enumerate(layers) if spec.window == w)) for w in windows)


@dataclass(frozen=True)
class LayerWeights:
    """A layer's tensor names under model.layers.N (Hugging Face), without the .weight suffix. A projection's
    parts stack along its output rows: (q, k, v) or one fused qkv. Norms a family lacks are None."""

    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    attn_norm: str = "input_layernorm"
    attn_out_norm: str | None = None        # a norm on attention's output, before the residual (Gemma)
    mlp_norm: str = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    q_norm: str | None = None               # RMS norms over each head's q and k, before rotary (Qwen3, Gemma 3)
    k_norm: str | None = None


# GGUF tensor names (llama.cpp's) for the Hugging Face names above: the common ones; a family adds or overrides.
GGUF_GLOBAL = (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"), ("output", "lm_head"))
GGUF_LAYER = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
              ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
              ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
              ("ffn_down", "mlp.down_proj"))


@dataclass(frozen=True)
class Gguf:
    """How llama.cpp writes a family: its architecture name, tensor names (GGUF piece, HF piece) per layer,
    whether q/k rows are in llama.cpp's rotary order (its Llama converter's `permute`), and the config fields
    its file gives beyond the common shape: `extra(field, tensor) -> dict`, field reading metadata `{arch}.key`,
    tensor reading one of config_tensors (tensors that hold settings, not weights: Phi-3's rope factors) as a
    list, or None where the file has none."""

    arch: str
    layer_names: tuple[tuple[str, str], ...] = GGUF_LAYER
    permuted_qk: bool = False
    extra: Callable[[Callable, Callable], dict] = lambda field, tensor: {}  # noqa: E731
    config_tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    architecture: str                       # config.json's architectures[0]
    model_type: str                         # config.json's model_type
    layers: Callable[[dict], tuple[LayerSpec, ...]]   # the per-layer recipe, from config.json
    weights: LayerWeights = field(default_factory=LayerWeights)
    gguf: Gguf | None = None                # None: llama.cpp writes this family under another's name
    activation: Activation = Activation.SILU
    norm: NormStyle = NormStyle.LLAMA
    embed_scale: bool = False               # embeddings times sqrt(hidden) (Gemma)
    qkv_bias: Callable[[dict], bool] = lambda cfg: bool(cfg.get("attention_bias", False))  # noqa: E731
    attention_scale: Callable[[dict], float | None] = lambda cfg: None  # noqa: E731 - None: head_dim ** -0.5
    system_role: bool = True                # False: the template has no system turn (see engine/chat_template.py)
    refuse: Callable[[dict], str | None] = lambda cfg: None  # noqa: E731 - what this reader cannot run, if any


# ---------------------------------------------------------------------------------------------------------------
# Reading the recipe from config.json: what most families share.


def base_rope(cfg: dict, params: dict | None = None) -> Rope:
    """The config's rotary table: transformers 5's rope_parameters, or older flat rope_theta/rope_scaling."""
    params = dict(params if params is not None else cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        params.update(cfg["rope_scaling"])
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it outside the rope parameters
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    return Rope.from_params(params, theta, cfg.get("max_position_embeddings", 2048))


def layer_windows(cfg: dict, sliding: bool | None = None) -> list[int | None]:
    """Each layer's window from layer_types and sliding_window; sliding=False: the config's switch says off."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if window is None or sliding is False:
        return [None] * n
    types = cfg.get("layer_types") or ["sliding_attention"] * n
    return [window if kind == "sliding_attention" else None for kind in types]


def uniform_layers(cfg: dict, sliding: bool | None = None) -> tuple[LayerSpec, ...]:
    rope = base_rope(cfg)
    return tuple(LayerSpec(rope, w) for w in layer_windows(cfg, sliding))
