"""Projections whose weights are a GGUF's own blocks, run by pagedchat's kernels (qmm.py): the quantized numbers
of the file, at the file's size in memory, on every CPU the kernels build for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedchat.model import qmm


@dataclass(frozen=True)
class Blocks:
    """A weight [N, K] as GGUF blocks: data [N, bytes per row] uint8, each row its own blocks."""

    data: np.ndarray
    kind: str

    @staticmethod
    def quantize(weight: torch.Tensor, kind: str) -> "Blocks":
        """A float weight quantized by gguf's own quantizer (what `--quantize` does to a safetensors model):
        this changes the model's numbers."""
        import gguf

        w = weight.detach().float().cpu().numpy()
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        return Blocks(np.ascontiguousarray(data).reshape(w.shape[0], -1), kind)


def concat(parts: list[Blocks]) -> Blocks:
    """Weights of one type stacked along N (q, k and v; gate and up), so that one matmul serves them all."""
    return Blocks(np.concatenate([p.data for p in parts]), parts[0].kind)


def block_parts(projection) -> tuple[list[torch.Tensor], list[str]] | None:
    """The panels and kinds of a projection that is block weights alone, without bias: one BlockLinear, or a
    Concat (linear.py) of them; None for any other."""
    parts = getattr(projection, "parts", [projection])
    if getattr(projection, "bias", None) is not None or \
            not all(isinstance(p, BlockLinear) and p.bias is None for p in parts):
        return None
    return [p.panels for p in parts], [p.kind for p in parts]


class BlockLinear:
    """y = x @ W.T + b for W held as its GGUF blocks in the kernels' layout (qmm.pack: panels of 16 rows, the
    file's bytes reordered)."""

    gathers_rows = True  # rows() reads single rows back: the embedding lookup of a tied head

    def __init__(self, panels: torch.Tensor, kind: str, bias: torch.Tensor | None = None):
        self.panels, self.kind, self.bias = panels, kind, bias
        self.out_features = panels.shape[0]

    @classmethod
    def of(cls, b: Blocks, bias: torch.Tensor | None = None) -> "BlockLinear":
        data = torch.from_numpy(np.array(b.data, dtype=np.uint8))  # a copy: the file stays closed
        return cls(qmm.pack(data, b.kind), b.kind, bias)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.panels, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Every row count on the integer kernels, the portable level's prompts too: a row's result must not
        # depend on how many rows share its step (docs/architecture.md#same-request-same-tokens).
        y = qmm.matmul(x, self.panels, self.kind)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of W in float32, exactly gguf's dequantization of them."""
        return qmm.dequantize(qmm.unpack(self.panels, self.kind, ids), self.kind)
