"""A projection (y = x @ W.T + b) with its weight stored in the layout its matmul runs fastest in.

On the CPU in bf16, torch's F.linear runs oneDNN on a plain row-major weight. Handing oneDNN the weight already
packed in its own blocked layout gives the same numbers bit for bit and ran the default model's projections
1.3-2x faster here (batch 1: 21 -> 12 ms a step for the 120 layer matmuls). oneDNN's packing is a private torch
op, so it is used only where a probe at load shows it present and exact; elsewhere, and in fp32 (where F.linear
takes MKL's sgemm, the kernel transformers uses, and oneDNN's differs in the last bits), the weight stays plain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False):
        self.bias = bias
        self.weight = None if packed else weight
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if packed else None

    @property
    def nbytes(self) -> int:
        """Bytes this projection keeps resident, in whatever layout it holds them."""
        held = [t for t in (self.weight, self._packed, self.bias) if t is not None]
        return sum(_resident_bytes(t) for t in held)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _resident_bytes(t: torch.Tensor) -> int:
    # oneDNN's packed tensor is opaque (no storage to ask): count its elements, which its blocked layout holds.
    return t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()


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
