"""The registry of model families: one module each, declaring what pagedchat/model/family.py describes.

Adding a family is one new module here, listed below, and its tests."""

from __future__ import annotations

from pagedchat.errors import ModelError
from pagedchat.model.families import gemma3, llama, mistral, phi3, qwen2, qwen3, smollm3
from pagedchat.model.family import Family

FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (llama, qwen2, qwen3, smollm3, mistral, gemma3, phi3))
_BY_ARCH = {f.architecture: f for f in FAMILIES}
_BY_TYPE = {f.model_type: f for f in FAMILIES}
_BY_GGUF = {f.gguf.arch: f for f in FAMILIES if f.gguf is not None}


def supported() -> str:
    return ", ".join(_BY_ARCH)


def of_config(cfg: dict) -> Family:
    """The family of a config.json: by its architectures, else by its model_type."""
    archs = cfg.get("architectures") or []
    family = _BY_ARCH.get(archs[0]) if archs else _BY_TYPE.get(cfg.get("model_type", ""))
    if family is None:
        name = archs[0] if archs else str(cfg.get("model_type"))
        raise ModelError(f"unsupported architecture {name!r}: pagedchat runs {supported()}")
    return family


def of_architecture(architecture: str) -> Family:
    return _BY_ARCH[architecture]


def of_gguf(arch: str | None, file_name: str) -> Family:
    family = _BY_GGUF.get(arch)
    if family is None:
        raise ModelError(f"{file_name}: unsupported GGUF architecture {arch!r}: pagedchat converts "
                         f"{', '.join(_BY_GGUF)}")
    return family
