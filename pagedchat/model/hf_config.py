"""The decoder's shape, read from a Hugging Face config.json by its family (pagedchat/model/families/)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedchat.errors import ModelError
from pagedchat.model import families
from pagedchat.model.family import Family, LayerSpec


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    layers: tuple[LayerSpec, ...] = ()     # each layer's rotary table and window (see model/family.py)
    attention_scale: float | None = None  # None: head_dim ** -0.5

    @property
    def family(self) -> Family:
        return families.of_architecture(self.architecture)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        family = families.of_config(cfg)
        refused = family.refuse(cfg)
        if refused:
            raise ModelError(f"unsupported {family.architecture}: {refused}")
        layers = family.layers(cfg)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=family.architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias(cfg),
            eos_token_ids=eos_ids,
            layers=layers,
            attention_scale=family.attention_scale(cfg),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"{folder}: no config.json, so this is not a Hugging Face model folder") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelError(f"{path}: not valid JSON ({exc})") from None
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ModelError(f"{path}: missing field {exc}") from None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
