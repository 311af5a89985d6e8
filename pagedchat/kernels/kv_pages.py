"""What the KV pages hold, element by element: the pool's page dtype (`kv_cache_dtype`, vLLM's name), which is
the pool's own and independent of the activations' dtype.

- float32, bfloat16: each key and value element as that type;
- int8: symmetric, one float32 scale per token and KV head (as llama.cpp's q8_0 cache keeps one per block):
  each (token, KV head) row is head_dim int8 codes followed by its scale's 4 bytes, so a page's tensor is int8
  [pages, block_size, kv_heads, head_dim + 4]. The scales live inside the pages: every copy of a page (copy on
  write, swapping to the CPU tier and back) carries them without knowing they are there.

Writers convert (bf16: round to nearest even, torch's own) or quantize (`encode`); readers take the pages
directly (the native and Triton kernels) or decode the pages they gather (`decode`, the torch path).
"""

from __future__ import annotations

import torch

from pagedchat.argtypes import KV_CACHE_DTYPES

_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "int8": torch.int8}
AUTO = torch.bfloat16  # what auto means: half float32's bytes, at the packed weights' parity (docs/memory.md)
SCALE_BYTES = 4      # an int8 row's float32 scale, after its codes
INT8_MAX = 127       # symmetric: codes in -127..127


def parse_kv_cache_dtype(value: str | torch.dtype | None) -> torch.dtype:
    """auto (or None): bf16 pages whatever the activations' dtype (half float32's bytes; docs/memory.md)."""
    if isinstance(value, torch.dtype):
        if value not in _NAMES.values():
            raise ValueError(f"KV pages cannot be {value}: use one of {', '.join(KV_CACHE_DTYPES)}")
        return value
    if value is None or str(value).lower() == "auto":
        return AUTO
    try:
        return _NAMES[str(value).lower()]
    except KeyError:
        raise ValueError(f"unknown kv_cache_dtype {value!r}: use one of {', '.join(KV_CACHE_DTYPES)}") from None


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in the cache tensor's last dimension."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one (token, KV head) row of K or V: an int8 row's scale included."""
    return row_width(head_dim, dtype) * torch.tensor([], dtype=dtype).element_size()


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] as the pages hold them: converted, or int8 codes with their scale appended."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / INT8_MAX
    # An all-zero row has scale 0: its codes are 0 whatever the divisor, so any positive one serves.
    codes = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-INT8_MAX, INT8_MAX)
    return torch.cat([codes.to(torch.int8), scale.view(torch.int8)], -1)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of encode, in dtype: an int8 row's codes times its scale (in float32, then dtype)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    codes, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)


def token_bytes(config, dtype: torch.dtype) -> int:
    """K and V of one token across every layer (config: a ModelConfig), in pages of dtype."""
    return 2 * config.num_layers * config.num_kv_heads * row_bytes(config.head_dim, dtype)
