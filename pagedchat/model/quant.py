"""4-bit packed weights: a GGUF's quantized blocks kept as the numbers they are, run by torch's int4 matmul.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations) computes x @ W.T with
W = scale * (q - 8) + zero: q a 4-bit code, one scale and one zero per group of 32 along the input. GGUF's
4-bit types are that form exactly:

    Q4_0   w = d (q - 8)            scale d        zero 0
    Q4_1   w = d q + m              scale d        zero m + 8d
    Q4_K   w = d sc q - dmin mn     scale d sc     zero 8 d sc - dmin mn   (each 32 of a 256 super-block)

Q8_0 (w = d q, q an int8) splits exactly into two 4-bit halves, q = 16 hi + lo with hi in -8..7, lo in 0..15:
w = 16d (hi + 8 - 8) + d (lo - 8) + 8d. It runs as one int4 matmul of [x | x] against [hi | lo], twice the
input width: no per-channel int8 kernel can keep Q8_0's per-32 scales. The one change to the file's numbers is
the kernel's: it holds scales and zeros in bf16, as it does activations.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch


GROUP = 32
# From this many rows (a prefill chunk) a matmul dequantizes its weight into float32 scratch and runs a dense
# GEMM instead of the int4 kernel: the kernel dequantizes the weight again for every 4 rows, so past a few
# hundred rows one dequantization plus MKL's sgemm is cheaper (docs/bench.md#a-dense-path-for-prefill-chunks).
# The scratch is reused, so no second resident copy of the weights exists.
DENSE_MIN_ROWS = 256
DENSE_SCRATCH_WEIGHTS = 1 << 21  # weights dequantized at a time: a few MB of scratch, whatever the matrix
# Types whose blocks map onto int4 groups; every other quantized type is dequantized (see GGUFTensor).
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


@dataclass(frozen=True)
class Int4Groups:
    """A weight [N, K] as 4-bit codes with a scale and a zero per group of 32 along K."""

    codes: np.ndarray  # [N, K] uint8 in 0..15
    scale: np.ndarray  # [N, K // 32] float32
    zero: np.ndarray   # [N, K // 32] float32
    source: str        # the quantized type the codes came from, for weight_precision
    doubled: bool = False  # Q8_0's two halves side by side: the input is [x | x]

    def rows(self, fn) -> "Int4Groups":
        """The same weight with fn applied along its rows (output channels) to codes, scales and zeros."""
        return replace(self, codes=fn(self.codes), scale=fn(self.scale), zero=fn(self.zero))

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in float32, as the kernel reconstructs it (scales and zeros rounded to bf16)."""
        codes, scale, zero = (torch.from_numpy(a) for a in (self.codes, self.scale, self.zero))
        return _reconstruct(codes, _bf16(scale), _bf16(zero), self.doubled)


def _bf16(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.bfloat16).float()


def _reconstruct(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, doubled: bool) -> torch.Tensor:
    """codes [R, K], scale/zero [R, K // 32] -> float32 [R, K] (or [R, K // 2], the halves summed, if doubled)."""
    w = (codes.float() - 8).view(codes.shape[0], -1, GROUP) * scale[..., None] + zero[..., None]
    w = w.view(codes.shape[0], -1)
    if doubled:
        hi, lo = w.chunk(2, dim=-1)
        w = hi + lo
    return w


def concat(parts: list[Int4Groups]) -> Int4Groups:
    """Weights stacked along N (q, k and v; gate and up), so that one matmul serves them all."""
    sources = dict.fromkeys(s for p in parts for s in p.source.split("+"))
    return Int4Groups(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                      np.concatenate([p.zero for p in parts]), "+".join(sources), parts[0].doubled)


# ---------------------------------------------------------------------------------------------------------------
# GGUF blocks -> groups


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _low_high(qs: np.ndarray) -> np.ndarray:
    """ggml's nibble order for 32 codes in 16 bytes: the low nibbles are codes 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_groups(blocks: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Groups:
    """A quantized tensor's raw blocks ([N, bytes per row] uint8, as gguf's reader holds them) as int4 groups."""
    import gguf

    n, k = shape
    b = blocks.reshape(n, -1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1])
    if kind == "Q4_0":
        d = _f16(b[..., 0:2])
        return Int4Groups(_low_high(b[..., 2:18]).reshape(n, k), d, np.zeros_like(d), kind)
    if kind == "Q4_1":
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        return Int4Groups(_low_high(b[..., 4:20]).reshape(n, k), d, m + 8 * d, kind)
    if kind == "Q4_K":
        return _q4_k(b, n, k)
    if kind == "Q8_0":
        d = _f16(b[..., 0:2])
        q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, k)
        hi = ((q >> 4) + 8).astype(np.uint8)  # arithmetic shift: -8..7, stored as 0..15
        lo = (q & 0x0F).astype(np.uint8)
        return Int4Groups(np.concatenate([hi, lo], axis=1), np.concatenate([16 * d, d], axis=1),
                          np.concatenate([np.zeros_like(d), 8 * d], axis=1), kind, doubled=True)
    raise ValueError(f"{kind} has no int4 mapping")


def _q4_k(b: np.ndarray, n: int, k: int) -> Int4Groups:
    """Q4_K super-blocks of 256: f16 d and dmin, 12 bytes of 6-bit sub-scales and mins, then 128 bytes of codes
    in runs of 64 (32 bytes: the low nibbles are the first 32 codes, the high ones the next 32)."""
    from gguf.quants import Q4_K

    supers = b.reshape(-1, b.shape[-1])
    d, dmin = _f16(supers[:, 0:2])[:, None], _f16(supers[:, 2:4])[:, None]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(supers[:, 4:16]))
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * mn.astype(np.float32)
    qs = supers[:, 16:144].reshape(-1, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)
    return Int4Groups(codes, scale.reshape(n, -1), zero.reshape(n, -1), "Q4_K")


def quantize(weight: torch.Tensor, kind: str) -> Int4Groups:
    """A float weight quantized group-wise by gguf's own quantizer (Q4_1 for int4, Q8_0 for int8): what
    `--quantize` does to a safetensors model. This changes the model's numbers."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    w = weight.detach().float().cpu().numpy()
    return replace(int4_groups(gguf.quants.quantize(w, qtype), kind, tuple(w.shape)), source=kind)


# ---------------------------------------------------------------------------------------------------------------
# The packed matmul


def int4_available() -> bool:
    """The CPU int4 kernel exists and computes what its formula says (another torch may lack or change it)."""
    return _int4_probe()


@functools.cache
def _int4_probe() -> bool:
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 64
    groups = Int4Groups(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8).numpy(),
                        torch.rand(n, k // GROUP, generator=gen).numpy(),
                        torch.randn(n, k // GROUP, generator=gen).numpy(),
                        "probe")
    try:
        linear = Int4Linear(groups)
        x = torch.randn(3, k, generator=gen).bfloat16()
        want = x.float() @ groups.dequantize().T
        return bool(torch.allclose(linear(x).float(), want, rtol=1e-2, atol=5e-2))
    except (RuntimeError, AttributeError):
        return False


class Int4Linear:
    """y = x @ W.T + b for W held as int4 groups in the kernel's packed layout."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None):
        codes = torch.from_numpy(np.ascontiguousarray(groups.codes)).to(torch.int32)
        # [K // 32, N, 2]: the kernel's order for (scale, zero) pairs.
        scale_zeros = torch.stack([torch.from_numpy(groups.scale).T, torch.from_numpy(groups.zero).T], dim=-1)
        self._init(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                   scale_zeros.to(torch.bfloat16).contiguous(), bias, groups.doubled, groups.source)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale_zeros: torch.Tensor, bias: torch.Tensor | None, *,
                    doubled: bool, source: str) -> "Int4Linear":
        """One restored from the packed-weights cache: the kernel's own tensors, as packing left them."""
        self = cls.__new__(cls)
        self._init(packed, scale_zeros, bias, doubled, source)
        return self

    def _init(self, packed, scale_zeros, bias, doubled: bool, source: str) -> None:
        self.packed, self.scale_zeros, self.bias = packed, scale_zeros, bias
        self.doubled, self.source = doubled, source
        self.out_features = scale_zeros.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scale_zeros, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())  # plain tensors, never shared

    @property
    def gathers_rows(self) -> bool:
        """Whether rows() can read single rows back (an embedding lookup on this weight)."""
        block = packed_block_rows()
        return block is not None and self.out_features % block == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= DENSE_MIN_ROWS and self.gathers_rows:
            y = self._dense_matmul(x)
        else:
            if self.doubled:
                x = torch.cat((x, x), dim=-1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zeros)
        return y if self.bias is None else y + self.bias

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with W dequantized into float32 scratch, a run of packed tiles at a time, each in its own order
        ([tiles, K, BLOCK]: no transpose), the same (q - 8) * scale + zero the kernel computes, then sgemm."""
        block = packed_block_rows()
        tiles, groups = self.out_features // block, self.scale_zeros.shape[0]
        k = groups * GROUP
        packed = self.packed.view(tiles, k, block // 2)
        # [groups, N, 2] -> [tiles, groups, 1, BLOCK]: one scale and zero per tile row and group of 32
        sz = self.scale_zeros.float().view(groups, tiles, 1, block, 2).transpose(0, 1)
        xf = x.float()
        y = torch.empty(tiles, x.shape[0], block)
        step = max(1, DENSE_SCRATCH_WEIGHTS // (k * block))
        for start in range(0, tiles, step):
            run = slice(start, min(start + step, tiles))
            torch.matmul(xf, _dequantize_tiles(packed[run], sz[run], self.doubled), out=y[run])
        return y.transpose(0, 1).reshape(x.shape[0], self.out_features).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of W in float32: an embedding lookup on a tied head, read from the packed codes (see
        gathers_rows) instead of a second copy of the table."""
        block = packed_block_rows()
        k = self.scale_zeros.shape[0] * GROUP
        tiles = self.packed.view(self.out_features // block, k, block // 2)
        half = block // 2
        byte = tiles[ids // block, :, ids % half]  # [T, K]
        shift = ((ids % block) >= half).to(torch.uint8)[:, None] * 4
        codes = (byte >> shift) & 0x0F
        sz = self.scale_zeros[:, ids].float()  # [K // 32, T, 2]
        return _reconstruct(codes, sz[..., 0].T, sz[..., 1].T, self.doubled)


def _dequantize_tiles(packed: torch.Tensor, sz: torch.Tensor, doubled: bool) -> torch.Tensor:
    """Packed tiles [n, K, BLOCK / 2] (byte j: row j's code low, row j + BLOCK / 2's high) and their scales and
    zeros [n, groups, 1, BLOCK, 2] -> float32 weights [n, K, BLOCK] (K halved, the halves summed, if doubled)."""
    n, k, half = packed.shape
    codes = _scratch(torch.uint8, (n, k, 2 * half))
    torch.bitwise_and(packed, 0x0F, out=codes[..., :half])
    torch.bitwise_right_shift(packed, 4, out=codes[..., half:])
    w = _scratch(torch.float32, (n, k // GROUP, GROUP, 2 * half))
    torch.addcmul(sz[..., 1], w.copy_(codes.view(w.shape)).sub_(8), sz[..., 0], out=w)
    w = w.view(n, k, 2 * half)
    return w[:, : k // 2].add_(w[:, k // 2 :]) if doubled else w  # the halves of [x | x]: one K-wide matmul


_scratch_of = threading.local()  # per compute thread: two engines in one process never share one


def _scratch(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A reused buffer of this thread's, grown to the largest weight it has held, viewed as shape."""
    buffers = _scratch_of.__dict__.setdefault("buffers", {})
    need = int(np.prod(shape))
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < need:
        buf = buffers[dtype] = torch.empty(need, dtype=dtype)
    return buf[:need].view(shape)


def packed_layout() -> str:
    """The packed layout on this machine, for keying saved packed weights: they are only valid where it holds."""
    return f"int4-rows-{packed_block_rows()}"


@functools.cache
def packed_block_rows() -> int | None:
    """The kernel's packed layout, probed: rows come in blocks of BLOCK rows, and byte (block, k, j) holds row
    j's code at k in its low nibble and row j + BLOCK/2's in its high one. BLOCK follows the CPU's vector width
    (64 with AVX-512, 32 with AVX2), so it is found by packing known codes, not assumed."""
    n, k = 128, 64
    codes = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :] * 3).remainder(16).to(torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except (RuntimeError, AttributeError):
        return None
    for block in (64, 32, 16):
        tiles = packed.reshape(n // block, k, block // 2)
        low, high = (tiles & 0x0F), (tiles >> 4)
        rebuilt = torch.cat([low, high], dim=2).permute(0, 2, 1).reshape(n, k)
        if torch.equal(rebuilt.to(torch.int32), codes):
            return block
    return None
