"""Projections (y = x @ W.T + b), each with its weight in the form its matmul runs fastest in.

- `Linear`: a dense weight. On the CPU in bf16, torch's F.linear runs oneDNN on a plain row-major weight;
  handing oneDNN the weight already packed in its own blocked layout gives the same numbers bit for bit and runs
  faster (docs/bench.md#the-bf16-engine-what-each-change-bought). oneDNN's packing is a private torch op, so it is
  used only where a probe at load shows it present and exact; elsewhere, and in fp32 (where F.linear takes MKL's
  sgemm, the kernel transformers uses, and oneDNN's differs in the last bits), the weight stays plain.
- `blocks.BlockLinear`: a GGUF's quantized blocks as the file holds them, run by pagedchat's kernels (qmm.py):
  the CPU's path wherever they are built, in float32 or bf16.
- `quant.Int4Linear`: a GGUF's 4-bit (and Q8_0) blocks, packed for torch's int4 kernel on bf16 activations: the
  path for the types it holds where pagedchat's kernels are not built.
- `Concat`: projections side by side, where a fused one (q, k and v) mixes types with no common form.

`build` picks among them for a model's weights: see `Placement`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedchat.model import hugepages, qmm, quant
from pagedchat.model.blocks import Blocks, BlockLinear, block_parts, concat
from pagedchat.model.forms import Dense, EmbedTable, Form, Int4Groups, Panels, Plain, Split

# `--quantize` on a safetensors model: gguf's group-wise quantizer of that width.
QUANTIZE_TYPES = {"int4": "Q4_1", "int8": "Q8_0"}


def resident(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory a tensor keeps alive. oneDNN's packed weights are opaque (no storage to
    ask): their bytes are their elements', which the blocked layout holds, padded at most to its block."""
    try:
        storage = t.untyped_storage()
    except NotImplementedError:
        return id(t), t.numel() * t.element_size()
    return storage.data_ptr(), storage.nbytes()


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the memory behind tensors, each piece once."""
    return sum(dict(resident(t) for t in tensors).values())


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False):
        self.bias = bias
        self.weight = None if packed else weight
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if packed else None

    def tensors(self) -> list[torch.Tensor]:
        """What this projection keeps resident, in whatever layout it holds it."""
        return [t for t in (self.weight, self._packed, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        return nbytes(self.tensors())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Concat:
    """Several projections of one input, their outputs side by side, then one bias."""

    def __init__(self, parts: list, bias: torch.Tensor | None):
        self.parts, self.bias = parts, bias
        self.blocks = block_parts(self)  # block weights of several kinds: one call, the input quantized once

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()] + ([] if self.bias is None else [self.bias])

    @property
    def nbytes(self) -> int:
        return nbytes(self.tensors())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return qmm.matmul_cat(x, *self.blocks)
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


def packing_is_exact(weight: torch.Tensor) -> bool:
    """Whether packed weights can serve this model: CPU bf16, the op present, and results equal to F.linear's."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = Linear(weight, packed=True)
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 7, 33):
            x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
            if not torch.equal(packed(x), F.linear(x, weight)):
                return False
        return True
    except (RuntimeError, AttributeError):  # an older or newer torch without these ops
        return False


@dataclass(frozen=True)
class Placement:
    """How a model's weights are held: dtype and device for dense ones, and whether quantized ones stay packed.

    blocks: quantized tensors stay the file's blocks, run by pagedchat's kernels (CPU, any dtype, the kernels
    built). int4: packed int4 matmuls on torch's kernel (CPU, bf16 activations; its fp32 path is a slow reference
    loop), for the types it holds, where pagedchat's kernels are not built. With
    neither, every quantized tensor is dequantized exactly (gguf's d*q+m) into dtype: the float32 path, whose
    tokens equal transformers'. quantize: "int4"/"int8" quantizes dense (safetensors) weights too."""

    dtype: torch.dtype
    device: torch.device
    int4: bool
    quantize: str | None = None
    onednn: bool = False  # dense bf16 weights pre-packed for oneDNN (see Linear)
    blocks: bool = False

    @classmethod
    def choose(cls, dtype: torch.dtype, device: torch.device, quantize: str | None) -> "Placement":
        cpu = device.type == "cpu"
        blocks = cpu and qmm.ensure() is None
        int4 = cpu and dtype == torch.bfloat16 and quant.int4_available() and not blocks
        probe = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
        return cls(dtype, device, int4, quantize, packing_is_exact(probe), blocks)

    def packed(self, w) -> Blocks | quant.Int4Groups | None:
        """w (a torch tensor or a loader.GGUFTensor) in the packed form this placement runs it in, if any."""
        if isinstance(w, torch.Tensor):
            if not self.quantize or w.dim() != 2 or w.shape[1] % quant.GROUP:
                return None
            if self.int4 and w.shape[0] % 16 == 0:
                return quant.quantize(w, QUANTIZE_TYPES[self.quantize])
            return Blocks.quantize(w, QUANTIZE_TYPES[self.quantize]) if self.blocks else None
        groups = w.int4() if self.int4 else None
        if groups is None and self.blocks:
            return w.blocks()
        return groups

    def dense(self, w) -> torch.Tensor:
        t = w if isinstance(w, torch.Tensor) else w.dense(self.dtype)
        return t.to(device=self.device, dtype=self.dtype)

    def unit_offset(self, w) -> torch.Tensor:
        """A (1 + w) norm weight in float32, as Gemma's RMSNorm computes it. llama.cpp's converter stores such a
        family's norms as the sum already (see families/gemma3.py), so a GGUF tensor is read as it is."""
        t = w.float() + 1.0 if isinstance(w, torch.Tensor) else w.dense(torch.float32)
        return t.to(self.device)

    def label(self, w, packed: Blocks | quant.Int4Groups | None) -> str:
        """What w is and how it runs, for DecoderModel.weight_precision: "Q4_1 packed", "Q8_0 as 2×int4",
        "Q6_K as bfloat16"."""
        if isinstance(packed, Blocks):
            return f"{packed.kind} packed" + (" (quantized at load)" if isinstance(w, torch.Tensor) else "")
        runs = str(self.dtype).removeprefix("torch.")
        if packed is not None:
            runs = "2×int4" if packed.doubled else "int4"
        if isinstance(w, torch.Tensor):  # a safetensors weight: as stored, or packed by --quantize
            return f"{runs} (quantized at load)" if packed is not None else runs
        return f"{w.kind} as {runs}"


@dataclass(frozen=True)
class PackedWeights:
    """A built model's record, as the packed-weights cache keeps it: Builder's tensors and forms by key."""

    tensors: dict[str, torch.Tensor]
    forms: dict[str, Form]
    embed: EmbedTable
    precision: str  # DecoderModel.precision
    huge_pages: hugepages.Collapser | None = None  # where the tensors still wait for their huge pages


class Builder:
    """Builds a model's projections and dense tensors under stable keys ("model.layers.3.qkv"), recording each
    one's final tensors and form: what the packed-weights cache saves. Built from such a record instead
    (`cached`), it only copies tensors in: no decoding, no packing."""

    def __init__(self, placement: Placement, cached: dict[str, torch.Tensor] | None = None,
                 forms: dict[str, Form] | None = None, embed: EmbedTable | None = None):
        self.placement = placement
        self.cached = cached
        self.forms: dict[str, Form] = dict(forms or {})
        self.embed = embed  # the token table's source, once chosen (DecoderModel._embedding)
        self.tensors: dict[str, torch.Tensor] = {}
        self.labels: list[str] = []

    def dense(self, key: str, w) -> torch.Tensor:
        t = self.cached[key] if self.cached is not None else self.placement.dense(w)
        self.tensors[key] = t
        self.forms[key] = Dense()
        return t

    def norm(self, key: str, w, unit_offset: bool) -> torch.Tensor:
        """A norm's weight: dense in dtype, or (unit_offset) as 1 + w in float32 (NormStyle.UNIT_OFFSET)."""
        if not unit_offset:
            return self.dense(key, w)
        t = self.cached[key] if self.cached is not None else self.placement.unit_offset(w)
        self.tensors[key] = t
        self.forms[key] = Dense()
        return t

    def projection(self, key: str, parts: list, bias: torch.Tensor | None = None):
        """One projection for weights stacked along the output (q, k, v): a single matmul wherever the parts
        share a form, each part's precision appended to labels."""
        if self.cached is not None:
            return self._restore(key)
        runs: list[tuple[object, list]] = []  # consecutive parts of one form: (form, weights, blocks or groups)
        for w in parts:
            p = self.placement.packed(w)
            self.labels.append(self.placement.label(w, p))
            form = None if p is None else p.kind if isinstance(p, Blocks) else p.doubled
            if runs and runs[-1][0] == form:
                runs[-1][1].append(w if p is None else p)
            else:
                runs.append((form, [w if p is None else p]))
        if len(runs) == 1:
            return self._single(key, *runs[0], bias)
        self.forms[key] = Split(len(runs))
        projections = [self._single(f"{key}.{i}", form, items, None) for i, (form, items) in enumerate(runs)]
        return Concat(projections, None if bias is None else self._bias(key, bias))

    def _bias(self, key: str, bias: torch.Tensor) -> torch.Tensor:
        self.tensors[f"{key}.bias"] = bias
        return bias

    def _single(self, key: str, form, items: list, bias: torch.Tensor | None):
        if bias is not None:
            bias = self._bias(key, bias)
        if isinstance(form, str):
            p = BlockLinear.of(concat(items) if len(items) > 1 else items[0], bias)
            self.tensors[f"{key}.panels"] = p.panels
            self.forms[key] = Panels(p.kind)
            return p
        if form is not None:
            p = quant.Int4Linear(quant.concat(items) if len(items) > 1 else items[0], bias)
            self.tensors[f"{key}.packed"], self.tensors[f"{key}.scale_zeros"] = p.packed, p.scale_zeros
            self.forms[key] = Int4Groups(p.doubled, p.source)
            return p
        dense = [self.placement.dense(w) for w in items]
        weight = torch.cat(dense) if len(dense) > 1 else dense[0]
        self.tensors[f"{key}.weight"] = weight
        self.forms[key] = Plain()
        return Linear(weight, bias, self.placement.onednn)

    def _restore(self, key: str):
        bias = self.cached.get(f"{key}.bias")
        match self.forms[key]:
            case Split(parts):
                return Concat([self._restore(f"{key}.{i}") for i in range(parts)], bias)
            case Panels(kind):
                return BlockLinear(self.cached[f"{key}.panels"], kind, bias)
            case Int4Groups(doubled, source):
                return quant.Int4Linear.from_packed(self.cached[f"{key}.packed"], self.cached[f"{key}.scale_zeros"],
                                                    bias, doubled=doubled, source=source)
        return Linear(self.cached[f"{key}.weight"], bias, self.placement.onednn)

    @property
    def runs_blocks(self) -> bool:
        return any(isinstance(f, Panels) for f in self.forms.values())

    @property
    def runs_int4(self) -> bool:
        return any(isinstance(f, Int4Groups) for f in self.forms.values())

    @property
    def packs(self) -> bool:
        """Whether anything was packed: only then is a cache worth its disk (dense weights load fast as they are)."""
        return self.runs_int4 or self.runs_blocks
