"""The packed-weights cache: a model's weights saved as the int4 kernel holds them, so a restart skips reading the
GGUF's metadata, decoding its blocks and packing (which together take seconds) and reads one safetensors file,
into huge pages (hugepages.py).

Only models with packed weights get one: their file holds the same 4-bit codes as the GGUF (about its size),
never a float32 copy. A cache entry is keyed by everything that shapes its bytes: the source file, the torch
version and the packed layout torch uses on this CPU, dtype and `--quantize`; a stale or damaged entry is
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from pagedchat import paths
from pagedchat.errors import ModelError
from pagedchat.model import hugepages, qmm, quant
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.forms import EmbedTable, decode, encode
from pagedchat.model.linear import Builder, PackedWeights
from pagedchat.model.decoder import DecoderModel
from pagedchat.model.loader import source_fingerprint

log = logging.getLogger(__name__)
FORMAT = "4"  # 4: typed forms (model/forms.py) and the token table's source apart from them


def cache_file(folder: Path, dtype: torch.dtype, quantize: str | None) -> Path:
    """Where the packed weights of this model, in this dtype and quantization, on this torch, are kept. Which
    tensors are GGUF blocks and which int4 groups depends on whether pagedchat's kernels serve here
    (linear.Placement), so that is part of the key, with torch's int4 layout."""
    layout = [qmm.ready(), quant.packed_layout()]
    key = json.dumps([FORMAT, source_fingerprint(folder), torch.__version__, layout, str(dtype), quantize])
    return paths.cache_dir() / "packed" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def read(path: Path) -> PackedWeights | None:
    """A cache entry, or None where there is none or it cannot be read (then it is rebuilt). Its weights are read
    into huge pages (hugepages.py): one chat's decode streams them every token."""
    if not path.is_file():
        return None
    try:
        tensors, meta, collapser = hugepages.read_safetensors(path)
        forms = {key: decode(text) for key, text in json.loads(meta["forms"]).items()}
        return PackedWeights(tensors, forms, EmbedTable(meta["embed"]), meta["precision"], collapser)
    except Exception as exc:  # a cut-off or foreign file: JSON, struct, key and size errors alike
        log.warning("ignoring unreadable packed-weights cache %s: %s", path, exc)
        return None


def write(path: Path, model: DecoderModel, built: Builder) -> None:
    """Save the model's built tensors atomically (temporary file, then rename): a crash leaves no half entry."""
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in built.tensors.items()}
    forms = json.dumps({key: encode(form) for key, form in built.forms.items()})
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata={"forms": forms, "embed": built.embed.value, "precision": model.precision})
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk costs the next start its speed, nothing else
        log.warning("could not write the packed-weights cache %s: %s", path, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_model(folder: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, quantize: str | None,
               read_weights: Callable) -> DecoderModel:
    """The model from its packed-weights cache where one is valid, else from its weights (saving a cache)."""
    cpu = device.type == "cpu"
    if cpu:
        qmm.ensure()  # the cache's layout depends on whether the kernels run
    path = cache_file(folder, dtype, quantize)
    model = _from_cache(path, config, device, dtype, quantize) if cpu else None
    if model is not None:
        return model
    model = DecoderModel(config, read_weights(folder, dtype, device), device, dtype, quantize)
    built, model.built = model.built, None
    if not built.packs:
        return model
    write(path, model, built)
    del built
    # Loaded back from the entry just written, the weights sit in huge pages as on every later start; an entry
    # that could not be written (a full disk) leaves the built model as it is.
    return _from_cache(path, config, device, dtype, quantize) or model


def _from_cache(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                quantize: str | None) -> DecoderModel | None:
    cached = read(path)
    if cached is None:
        return None
    try:
        model = DecoderModel(config, None, device, dtype, quantize, cached)
    except (ModelError, KeyError, ValueError, RuntimeError) as exc:  # written by another version, say
        log.warning("rebuilding the packed-weights cache %s: %s", path, exc)
        return None
    model.built = None  # its record holds plain copies of weights oneDNN packed: let them go
    return model
