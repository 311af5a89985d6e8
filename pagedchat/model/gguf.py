"""GGUF files: their metadata as a Hugging Face folder, their tensors as the model reads them.

A GGUF is converted once into a folder of the cache (config, generation config, tokenizer, chat template: a few
MB) with a pointer to the file; its weights stay in the GGUF, read from its memory map at each load: quantized
tensors go to the model as they are (see GGUFTensor and pagedchat/model/quant.py), never as a float32 copy on
disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedchat.errors import ModelError, first_line
from pagedchat.model import families, qmm, quant, tokenizer
from pagedchat.model.blocks import Blocks
from pagedchat.model.family import GGUF_GLOBAL

Progress = Callable[[str, "float | None"], None]

# Written last into a converted folder: a folder without it is a leftover and is never used.
COMPLETE_MARKER = ".pagedchat-complete"
# In a converted folder: which GGUF holds the weights. Folders converted before it held float32 safetensors.
GGUF_POINTER = "gguf.json"

# The shape of each Hugging Face tensor piece (see family.LayerWeights), from the config; norms are (hidden,).
_SHAPES = {
    "self_attn.q_proj": lambda c: (c.q, c.h), "self_attn.k_proj": lambda c: (c.kv, c.h),
    "self_attn.v_proj": lambda c: (c.kv, c.h), "self_attn.qkv_proj": lambda c: (c.q + 2 * c.kv, c.h),
    "self_attn.o_proj": lambda c: (c.h, c.q), "mlp.gate_proj": lambda c: (c.inter, c.h),
    "mlp.up_proj": lambda c: (c.inter, c.h), "mlp.gate_up_proj": lambda c: (2 * c.inter, c.h),
    "mlp.down_proj": lambda c: (c.h, c.inter), "self_attn.q_norm": lambda c: (c.d,),
    "self_attn.k_norm": lambda c: (c.d,),
}
_BIASED = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv"}  # GGUF pieces that carry a bias where the config says


@dataclass(frozen=True)
class _Dims:
    h: int
    inter: int
    d: int
    q: int
    kv: int


def report(progress: Progress | None, message: str, fraction: float | None = None) -> None:
    """Tell an optional progress callback where the work stands."""
    if progress is not None:
        progress(message, fraction)



def open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except FileNotFoundError:
        raise ModelError(f"no such GGUF file: {path}") from None
    except Exception as exc:  # the reader raises whatever numpy does on a bad or cut-off file
        raise ModelError(f"{path.name}: not a readable GGUF file, corrupt or truncated ({first_line(exc)})") from None


def _field(reader, key: str, default=None):
    """A scalar or string metadata value, read via parts/data so older gguf versions work too."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    part = field.parts[field.data[0]]
    if len(field.types) == 1 and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part[0].item() if hasattr(part[0], "item") else part[0]


def _f32(value) -> float:
    """GGUF stores these as float32; write 1e-05, not its float64 expansion 9.999999747378752e-06."""
    return float(f"{float(value):.7g}")


def _setting_tensor(tensors: dict, name: str) -> list[float] | None:
    """A small float tensor that holds a setting (see family.Gguf.config_tensors), as a list; None if absent."""
    t = tensors.get(name)
    return None if t is None else np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()


def _gguf_config(reader, path: Path) -> dict:
    """config.json contents for a GGUF of a registered family, from its metadata and tensor list."""
    arch = _field(reader, "general.architecture")
    family = families.of_gguf(arch, path.name)
    key = lambda name: f"{arch}.{name}"  # noqa: E731 - metadata keys are prefixed with the architecture
    tensors = {t.name: t for t in reader.tensors}
    extra = family.gguf.extra(lambda name: _field(reader, key(name)), lambda name: _setting_tensor(tensors, name))
    if (_field(reader, key("rope.scaling.type")) or "none") != "none" and "rope_parameters" not in extra:
        raise ModelError(f"{path.name}: rope scaling {_field(reader, key('rope.scaling.type'))!r} is not supported")
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style scaling is stored as a frequency table whose parameters a HF config cannot be rebuilt from.
        raise ModelError(f"{path.name}: Llama 3.1-style rope frequency scaling in GGUF is not supported")
    try:
        hidden = int(_field(reader, key("embedding_length")))
        heads = int(_field(reader, key("attention.head_count")))
        cfg = {
            "hidden_size": hidden,
            "intermediate_size": int(_field(reader, key("feed_forward_length"))),
            "num_hidden_layers": int(_field(reader, key("block_count"))),
            "num_attention_heads": heads,
        }
    except TypeError:
        raise ModelError(f"{path.name}: GGUF metadata lacks the model's shape ({arch}.* keys)") from None
    kv_heads = int(_field(reader, key("attention.head_count_kv"), heads))
    head_dim = int(_field(reader, key("attention.key_length"), 0) or _field(reader, key("rope.dimension_count"), 0)
                   or hidden // heads)
    if "token_embd.weight" not in tensors:
        raise ModelError(f"{path.name}: GGUF has no token_embd.weight tensor")
    # The embedding's row count is the true vocabulary size; the metadata key is optional in older files.
    vocab = int(tensors["token_embd.weight"].shape[-1])
    theta = _f32(_field(reader, key("rope.freq_base"), 10000.0))
    bos, eos, pad = (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    eos_ids = [i for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id")) if i is not None]
    eos_ids = list(dict.fromkeys(int(i) for i in eos_ids))
    cfg.update({
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_field(reader, key("attention.layer_norm_rms_epsilon"), 1e-6)),
        # Flat rope_theta for transformers 4, rope_parameters for transformers 5.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(_field(reader, key("context_length"), 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        # A family with q/k/v biases always (Qwen2) has them whatever this says: a file without them is then
        # reported as missing tensors.
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    })
    cfg.update(extra)
    return cfg


def _expected_shapes(cfg: dict, tensors: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (torch shape, GGUF name) for every tensor the model needs, in file order."""
    family = families.of_config(cfg)
    d = cfg["head_dim"]
    dims = _Dims(cfg["hidden_size"], cfg["intermediate_size"], d, cfg["num_attention_heads"] * d,
                 cfg["num_key_value_heads"] * d)
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for gname, hf in GGUF_GLOBAL:
        if gname == "output" and cfg["tie_word_embeddings"]:
            continue
        shape = (cfg["vocab_size"], dims.h) if gname != "output_norm" else (dims.h,)
        out[hf + ".weight"] = (shape, gname + ".weight")
    biased = family.qkv_bias(cfg)
    for n in range(cfg["num_hidden_layers"]):
        for gname, hf in family.gguf.layer_names:
            shape = _SHAPES.get(hf, lambda c: (c.h,))(dims)
            out[f"model.layers.{n}.{hf}.weight"] = (shape, f"blk.{n}.{gname}.weight")
            if biased and gname in _BIASED:
                out[f"model.layers.{n}.{hf}.bias"] = ((getattr(dims, _BIASED[gname]),), f"blk.{n}.{gname}.bias")
    wanted = {g for _, g in out.values()}
    settings = set(family.gguf.config_tensors)
    missing = sorted(wanted - set(tensors))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"GGUF is missing tensor {missing[0]}{more}")
    extra = sorted(set(tensors) - wanted - settings)
    if extra:
        raise ModelError(f"GGUF has tensor {extra[0]} that a plain {cfg['model_type']} model does not use")
    return out


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary re-ordering of q/k rows (its convert_hf_to_gguf `permute`, for llama only).

    llama.cpp interleaves each head's two rotary halves; Hugging Face keeps them as halves. This is the inverse,
    as in transformers' LlamaTensorProcessor._reverse_permute_weights.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF, read lazily from the file's memory map, in the form the model asks for."""

    name: str
    kind: str                # the GGML type name: F32, Q4_1, Q8_0, Q6_K...
    shape: tuple[int, ...]   # torch order
    data: np.ndarray         # the raw blocks as gguf's reader maps them
    heads: int = 0           # q/k of a family llama.cpp permutes: undo its rotary row order over this many heads

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized by gguf's own code (what transformers' GGUF loader runs), d*q+m in float32, then dtype."""
        import gguf

        try:
            arr = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.kind])
        except NotImplementedError:
            raise ModelError(f"tensor {self.name} uses {self.kind}, which gguf cannot dequantize") from None
        except Exception as exc:
            raise ModelError(f"tensor {self.name} could not be read ({first_line(exc)}); the GGUF is corrupt") from None
        w = np.array(arr.reshape(self.shape), dtype=np.float32)  # a copy: an F32 tensor's array is the read-only map
        if self.heads:
            w = np.ascontiguousarray(_unpermute_qk(w, self.heads))
        return torch.from_numpy(w).to(dtype)

    def int4(self) -> quant.Int4Groups | None:
        """The tensor as int4 groups with its own numbers, or None for types with no such mapping."""
        if self.kind not in quant.INT4_TYPES or len(self.shape) != 2 or self.shape[0] % 16:
            return None
        groups = quant.int4_groups(self.data, self.kind, self.shape)
        return groups.rows(lambda a: _unpermute_qk(a, self.heads)) if self.heads else groups

    def blocks(self) -> Blocks | None:
        """The tensor as the file's own blocks, row by row, for pagedchat's kernels; None for types they do not
        run. Each row's blocks are its own, so llama's q/k row order is undone on whole rows."""
        if self.kind not in qmm.TYPES or len(self.shape) != 2:
            return None
        rows = np.ascontiguousarray(self.data).reshape(self.shape[0], -1)
        return Blocks(np.ascontiguousarray(_unpermute_qk(rows, self.heads)) if self.heads else rows, self.kind)


def gguf_tensors(reader, cfg: dict, path: Path) -> dict[str, GGUFTensor]:
    """Every tensor the model needs under its Hugging Face name, shapes checked against the metadata."""
    tensors = {t.name: t for t in reader.tensors}
    try:
        specs = _expected_shapes(cfg, tensors)
    except ModelError as exc:
        raise ModelError(f"{path.name}: {exc}") from None
    out = {}
    for name, (shape, gname) in specs.items():
        t = tensors[gname]
        # GGUF lists dims innermost first; reversed they are torch's order, which the config fixes independently.
        found = tuple(reversed([int(x) for x in t.shape]))
        if found != shape:
            raise ModelError(f"{path.name}: tensor {gname} has shape {found}, but the GGUF metadata implies {shape}")
        heads = 0
        if families.of_config(cfg).gguf.permuted_qk and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if gname.split(".")[-2] == "attn_q" else cfg["num_key_value_heads"]
        out[name] = GGUFTensor(gname, t.tensor_type.name, shape, t.data, heads)
    return out


def _gguf_tokenizer(gguf_path: Path):
    """transformers' tokenizer of a GGUF. AutoTokenizer reads the architectures transformers has a GGUF model
    reader for; the plain fast tokenizer, built from the same tokenizer.ggml.* fields, serves the others
    (SmolLM3)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError:
        return PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _convert_tokenizer(gguf_path: Path, out_dir: Path, cfg: dict, chat_template: str | None) -> None:
    """Tokenizer files via transformers' GGUF tokenizer support, checked to keep the eos token and template, and
    recorded for starts without transformers (see tokenizer.py)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its GGUF path logs informational noise we do not want in a TUI
    try:
        tok = _gguf_tokenizer(gguf_path)
        if chat_template and not tok.chat_template:
            tok.chat_template = chat_template
        tok.model_max_length = cfg["max_position_embeddings"]  # GGUF sets none, which saves as a 1e30 sentinel
        tok.save_pretrained(out_dir)
        saved = AutoTokenizer.from_pretrained(out_dir)
    except Exception as exc:
        raise ModelError(f"{gguf_path.name}: could not build its tokenizer ({first_line(exc)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    eos = cfg["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and saved.eos_token_id not in eos_ids:
        raise ModelError(f"{gguf_path.name}: converted tokenizer's eos id {saved.eos_token_id} is not the GGUF's {eos}")
    if chat_template and saved.chat_template != chat_template:
        raise ModelError(f"{gguf_path.name}: the chat template did not survive tokenizer conversion")
    tokenizer.record(out_dir, saved)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: Progress | None = None,
                 weights: str | None = None) -> Path:
    """Write a Hugging Face folder for a GGUF: config, generation config, tokenizer, and GGUF_POINTER naming the
    GGUF the weights are read from at load (`weights`, relative to the folder or absolute; default gguf_path).
    No weights are written: they stay quantized in the GGUF."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    report(progress, f"reading {gguf_path.name}")
    reader = open_gguf(gguf_path)
    cfg = _gguf_config(reader, gguf_path)
    gguf_tensors(reader, cfg, gguf_path)  # a file with missing or misshapen tensors is refused now, not at load
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    report(progress, "converting the tokenizer", 0.5)
    _convert_tokenizer(gguf_path, out_dir, cfg, _field(reader, "tokenizer.chat_template"))
    (out_dir / GGUF_POINTER).write_text(json.dumps({"file": weights or str(gguf_path.resolve())}) + "\n")
    report(progress, "converted", 1.0)
    return out_dir


def gguf_weights(folder: str | os.PathLike) -> Path | None:
    """The GGUF a converted folder reads its weights from, or None for a folder of safetensors."""
    pointer = Path(folder) / GGUF_POINTER
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text())["file"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise ModelError(f"{pointer}: unreadable; delete the folder to convert the model again") from None
    return Path(folder) / name


def is_complete(folder: Path) -> bool:
    return (Path(folder) / COMPLETE_MARKER).is_file()


def convert_gguf_into_place(gguf_path: str | os.PathLike, final_dir: str | os.PathLike,
                            progress: Progress | None = None, replace: bool = False, keep: bool = False) -> Path:
    """convert_gguf into a temporary sibling, then rename it to final_dir: a crash never leaves half a model there.

    replace=True swaps out a complete final_dir too (a forced re-pull); otherwise a complete one is kept.
    keep=True moves the GGUF itself into the folder (a pulled model, whose download folder goes away);
    otherwise the folder points at the GGUF where it lies.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        if keep:
            gguf_path = Path(shutil.move(str(gguf_path), tmp / Path(gguf_path).name))
        convert_gguf(gguf_path, tmp, progress, weights=Path(gguf_path).name if keep else None)
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        _move_into_place(tmp, final_dir, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def _move_into_place(tmp: Path, final_dir: Path, replace: bool) -> None:
    if final_dir.exists():
        if is_complete(final_dir) and not replace:
            return  # another process finished the same conversion first; theirs is as good as ours
        # An incomplete leftover (or a forced refresh): move it aside first, so the rename below cannot fail.
        trash = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old-", dir=final_dir.parent))
        os.replace(final_dir, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, final_dir)
    except OSError:
        if not is_complete(final_dir):  # lost a race to a finished folder is fine; anything else is not
            raise


def gguf_fingerprint(path: Path) -> str:
    """Identify a GGUF by its size and first and last MiB: cheap on multi-GiB files, and changes if it is replaced."""
    mib = 1 << 20
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(mib))
        f.seek(max(0, size - mib))
        h.update(f.read(mib))
    return h.hexdigest()
