"""The decoder's shape, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedchat.errors import ModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


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
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
            cfg.get("model_type", ""), str(cfg.get("model_type")))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture {arch!r}: pagedchat runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        # transformers 5 nests rope settings under rope_parameters; older configs keep them flat.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ModelError(f"unsupported rope scaling {kind!r}: pagedchat implements default and llama3")
            if kind == "default":
                scaling = None
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        is_qwen = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
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
