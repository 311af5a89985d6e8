"""The form each of a model's tensors is held in, as typed values: what `linear.Builder` records while it builds a
model, what the packed-weights cache saves beside the tensors (as short text), and what names the path each
projection runs on (`path`).

A projection is `Plain` (a dense weight, torch's F.linear), `Panels` (a GGUF's blocks in pagedchat's kernel
panels), `Int4Groups` (4-bit groups on torch's int4 kernel) or `Split` (parts of different forms side by side);
other tensors (norm weights, a dense embedding table) are `Dense`. The embedding table is also one of
`EmbedTable`'s choices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class Dense:
    """A tensor used as it is: a norm's weight, a dense embedding table."""


@dataclass(frozen=True)
class Plain:
    """A dense projection weight, run by F.linear (in bf16 on the CPU, pre-packed for oneDNN where exact)."""


@dataclass(frozen=True)
class Panels:
    """A GGUF's quantized blocks of one type, in pagedchat's kernel panels."""

    kind: str  # the GGUF type, "Q4_K"


@dataclass(frozen=True)
class Int4Groups:
    """4-bit groups on torch's int4 kernel (bf16 activations), where pagedchat's kernels are not built."""

    doubled: bool  # Q8_0 held as two int4 halves
    source: str    # the GGUF type the codes came from


@dataclass(frozen=True)
class Split:
    """A fused projection (q, k, v) whose parts have no common form: `parts` projections side by side."""

    parts: int


Form = Dense | Plain | Panels | Int4Groups | Split


class EmbedTable(enum.Enum):
    """Where the token table comes from."""

    HEAD = "head"      # the tied output head itself (rows read back from its form)
    PACKED = "packed"  # a packed copy of an untied quantized table
    DENSE = "dense"    # a dense table in the model's dtype


def encode(form: Form) -> str:
    """A form as the packed-weights cache saves it."""
    match form:
        case Panels(kind):
            return f"panels {kind}"
        case Int4Groups(doubled, source):
            return f"int4 {int(doubled)} {source}"
        case Split(parts):
            return f"split {parts}"
        case Plain():
            return "plain"
        case Dense():
            return "dense"
    raise TypeError(f"not a form: {form!r}")


def decode(text: str) -> Form:
    """encode's inverse. Raises ValueError for text no version of encode writes (a damaged cache)."""
    name, *args = text.split(" ")
    match name, args:
        case "panels", [kind]:
            return Panels(kind)
        case "int4", [doubled, source] if doubled in ("0", "1"):
            return Int4Groups(doubled == "1", source)
        case "split", [parts] if parts.isdigit():
            return Split(int(parts))
        case "plain", []:
            return Plain()
        case "dense", []:
            return Dense()
    raise ValueError(f"unknown weight form {text!r}")


def path(form: Form, kernels: str, dense: str) -> str:
    """The kernel a projection of this form runs on, in words: kernels names pagedchat's (qmm.describe), dense
    how a plain weight runs here ("bfloat16, oneDNN packed")."""
    match form:
        case Panels(kind):
            return f"{kind} panels on {kernels}"
        case Int4Groups(doubled, source):
            return f"{source} as {'2×' if doubled else ''}int4 groups on torch's int4 kernel"
        case Plain() | Dense():
            return f"dense {dense} on torch"
        case Split():
            return "parts side by side"
    raise TypeError(f"not a form: {form!r}")
