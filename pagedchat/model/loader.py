"""Finding a model and reading it: Hugging Face folders, hub ids, and GGUF files (see gguf.py).

The engine reads a Hugging Face-shaped folder: config.json, tokenizer files, and weights (safetensors here, or
the GGUF a converted folder points at).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from pagedchat import paths
from pagedchat.errors import ModelError, first_line
from pagedchat.model import tokenizer
from pagedchat.model.gguf import (GGUF_POINTER, GGUFTensor, Progress, convert_gguf_into_place, gguf_fingerprint,
                                  gguf_tensors, gguf_weights, is_complete, open_gguf, report)
from pagedchat.model.pull import pull_default_model

_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# ---------------------------------------------------------------------------------------------------------------
# Finding a model


def source_fingerprint(folder: str | os.PathLike) -> str:
    """What identifies a model folder's weights: its GGUF's fingerprint, or its safetensors files' names, sizes
    and modification times (cheap, and any rewrite changes them)."""
    gguf_path = gguf_weights(folder)
    if gguf_path is not None:
        return gguf_fingerprint(gguf_path)
    files = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in _weight_files(Path(folder))
             if p.is_file()]
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def _resolve_gguf(path: Path, progress: Progress | None) -> Path:
    folder = paths.cache_dir() / "models" / f"gguf-{gguf_fingerprint(path)}"
    if is_complete(folder) and gguf_weights(folder) is not None:
        if gguf_weights(folder) != path.resolve():  # the same file, moved or copied: read it where it is now
            (folder / GGUF_POINTER).write_text(json.dumps({"file": str(path.resolve())}) + "\n")
        return folder
    # Absent, or converted by an older pagedchat into float32 safetensors: convert (replacing that copy).
    return convert_gguf_into_place(path, folder, progress, replace=True)


def _resolve_hub(repo_id: str, progress: Progress | None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        report(progress, f"downloading {repo_id} from the Hugging Face hub")
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:
        raise ModelError(f"could not download {repo_id} from the Hugging Face hub: {first_line(exc)}") from None
    if not (folder / "config.json").is_file():
        raise ModelError(f"{repo_id} on the Hugging Face hub has no config.json, so it is not a transformers model")
    return folder


def resolve_model(spec: str | os.PathLike | None, progress: Progress | None = None) -> Path:
    """A Hugging Face model folder for spec: None (the default model), a folder, a .gguf file, or a hub id."""
    if spec is None:
        return pull_default_model(progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec}: no config.json, so this is not a Hugging Face model folder")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{spec}: not a model (give a model folder, a .gguf file, or a hub id)")
        return _resolve_gguf(path, progress)
    if isinstance(spec, str) and _HUB_ID.match(spec) and not spec.lower().endswith(".gguf"):
        return _resolve_hub(spec, progress)
    raise ModelError(f"no such model: {spec} (give a model folder, a .gguf file, or a hub id)")


# ---------------------------------------------------------------------------------------------------------------
# Reading a Hugging Face folder


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ModelError(f"{index.name}: not a valid safetensors index ({first_line(exc)})") from None
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelError(f"{folder}: no model.safetensors (pagedchat reads safetensors weights only)")


def load_weights(folder: str | os.PathLike, dtype: torch.dtype, device) -> dict[str, torch.Tensor | GGUFTensor]:
    """Every tensor under its Hugging Face name: from safetensors in dtype on device, or from the folder's GGUF
    as GGUFTensors (memory-mapped, still quantized) for the model to place."""
    gguf_path = gguf_weights(folder)
    if gguf_path is not None:
        reader = open_gguf(gguf_path)
        return gguf_tensors(reader, json.loads((Path(folder) / "config.json").read_text()), gguf_path)
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        if not path.is_file():
            raise ModelError(f"{path.name}: weight file listed in the index is missing from {folder}")
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    weights[name] = t.to(dtype) if t.is_floating_point() else t
        except Exception as exc:  # safetensors reports bad headers and short files with its own error type
            raise ModelError(f"{path.name}: corrupt or truncated safetensors file ({first_line(exc)})") from None
    return weights


def load_tokenizer(folder: str | os.PathLike):
    """The folder's tokenizer: from its record in the cache where one is saved (see tokenizer.py), else
    transformers' own, recorded for the next start where a record can stand for it. A missing chat template is
    left for the engine to fall back on."""
    try:
        where = tokenizer.record_dir(Path(folder))
    except OSError:
        where = None  # an unreadable folder: transformers says what is wrong with it
    fast = tokenizer.read_record(where) if where else None
    if fast is not None:
        return fast
    hf = _transformers_tokenizer(folder)
    return (tokenizer.record(Path(folder), hf) if where else tokenizer.from_transformers(hf)) or hf


# tokenizer_config.json classes that are the plain tokenizers-library tokenizer, which AutoTokenizer would
# resolve to PreTrainedTokenizerFast (TokenizersBackend) after importing its whole model registry.
_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _transformers_tokenizer(folder: str | os.PathLike):
    """transformers' tokenizer for the folder. A plain tokenizer.json (what every converted GGUF has) is loaded
    as the class AutoTokenizer would pick, without AutoTokenizer's registry lookups."""
    try:
        declared = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None  # no readable config: AutoTokenizer decides, and reports what is wrong
    if declared in _PLAIN_TOKENIZERS and (Path(folder) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader
    try:
        return loader.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"{folder}: could not load its tokenizer ({first_line(exc)})") from None


def eos_token_ids(folder: str | os.PathLike, config_eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """Every id that ends a reply: generation_config.json's, config.json's and the tokenizer's, in that order."""
    ids: list[int] = []
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            value = None  # a broken generation config only loses extra stop ids; config.json still has its own
        ids += value if isinstance(value, list) else ([value] if value is not None else [])
    ids += list(config_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.append(tok_eos)
    return tuple(dict.fromkeys(int(i) for i in ids))
