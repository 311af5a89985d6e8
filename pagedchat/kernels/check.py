"""Device check: every Triton kernel against its reference on realistic shapes, plus timings.

    python -m pagedchat.kernels.check

On CUDA: SmolLM2-135M and Qwen2.5-7B attention shapes in fp16/bf16, mixed-length batches, prefill
chunks after a cached prefix, split-K off and at 64 keys; then the kernel timed against torch SDPA over K/V
gathered from the pages. Without CUDA it says so and exits 0, unless TRITON_INTERPRET=1, where it
runs the correctness part on tiny shapes in the interpreter. Exit status 1 on any mismatch.
`make_batch` is also what tests/test_kernels.py builds its cases with.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from pagedchat.kernels import reference
from pagedchat.kernels import kv_pages


@dataclass
class Batch:
    q: torch.Tensor  # [T, num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    scale: float
    max_query_len: int
    max_context_len: int
    keys: list[torch.Tensor]  # per sequence, contiguous [ctx, kv_heads, head_dim]: the truth
    values: list[torch.Tensor]

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale, self.max_query_len, self.max_context_len)


def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.float32,
               device="cpu", share_pages=0, seed=0, kv_dtype: torch.dtype | None = None) -> Batch:
    """A paged batch for `seqs` = [(context_len, query_len), ...].

    Pages come from a shuffled pool with spare pages, so tables are scattered. Slots never written
    hold NaN, and block tables are padded with a NaN page, so a kernel that reads past a sequence's
    context (or its table) produces NaN instead of silently passing. With share_pages=n > 0, every
    later sequence shares sequence 0's first n full pages (same prefix tokens; as many as its own context
    fills), as prefix caching does with a common system prompt. kv_dtype: the pages' (kernels/kv_pages.py;
    default dtype's), whose keys and values are then the truth (an int8 page's unwritten rows get a NaN scale).
    """
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    num_pages = sum(pages_needed) + 3
    pool = torch.randperm(num_pages, generator=gen).tolist()
    nan_page = pool.pop()  # never written: padding for block tables

    shape = (num_pages, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables, keys, values = [], [], []
    for b, ((ctx, _), n_pages) in enumerate(zip(seqs, pages_needed)):
        shared = min(share_pages, ctx // block_size) if b > 0 else 0
        assert not shared or seqs[0][0] >= shared * block_size, "sequence 0 must fill shared pages"
        pages = (tables[0][:shared] if shared else []) + [pool.pop() for _ in range(n_pages - shared)]
        tables.append(pages)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        if shared:  # the shared prefix has the same tokens, hence the same K/V
            k[: shared * block_size] = keys[0][: shared * block_size]
            v[: shared * block_size] = values[0][: shared * block_size]
        keys.append(k)
        values.append(v)
        pos = torch.arange(ctx)
        slots = torch.tensor(pages)[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v

    if kv_dtype is not None and kv_dtype != dtype:
        k_cache, v_cache = kv_pages.encode(k_cache, kv_dtype), kv_pages.encode(v_cache, kv_dtype)
        keys = [kv_pages.decode(kv_pages.encode(k, kv_dtype), dtype) for k in keys]
        values = [kv_pages.decode(kv_pages.encode(v, kv_dtype), dtype) for v in values]
    max_blocks = max(pages_needed) + 1  # one extra column of padding even for the longest
    block_tables = torch.full((len(seqs), max_blocks), nan_page, dtype=torch.int32)
    for b, pages in enumerate(tables):
        block_tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    qlens = [qlen for _, qlen in seqs]
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=gen).to(dtype)
    to = dict(device=device)
    return Batch(
        q=q.to(**to), k_cache=k_cache.to(**to), v_cache=v_cache.to(**to),
        block_tables=block_tables.to(**to),
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, **to),
        query_start_loc=torch.tensor([0] + qlens, **to).cumsum(0).to(torch.int32),
        scale=head_dim ** -0.5, max_query_len=max(qlens), max_context_len=max(c for c, _ in seqs),
        keys=[x.to(**to) for x in keys], values=[x.to(**to) for x in values],
    )


TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # atol = rtol


def compare(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[float, bool]:
    """Max abs error, and whether |got - want| <= tol * (1 + |want|) everywhere (NaN fails)."""
    diff = (got.float() - want.float()).abs()
    return diff.max().item(), bool((diff <= tol * (1 + want.float().abs())).all())


# Tiny shapes are for the interpreter; the realistic ones for the device.
MODELS = {"SmolLM2-135M": (9, 3, 64), "Qwen2.5-7B": (28, 4, 128)}
TINY_MODELS = {"tiny-gqa3": (6, 2, 64)}
# (context_len, query_len) per sequence; the later ones share sequence 0's first page where they fill it.
MIXED = [(4000, 1), (17, 1), (1, 1), (300, 1), (1000, 1)]
PREFILL = [(1300, 45), (300, 300), (64, 1), (4096, 512)]
TINY_MIXED = [(100, 1), (17, 1), (1, 1)]
TINY_PREFILL = [(90, 23), (40, 40), (16, 1)]


def _same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    # Compare bits, not values: the caches hold NaN in unwritten slots.
    return all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))


def check_correctness(device: str, models: dict, dtypes, mixed, prefill) -> bool:
    from pagedchat import kernels
    from pagedchat.kernels import triton_attention

    ok = True

    def report(name, err, good):
        nonlocal ok
        ok &= good
        print(f"  {'ok ' if good else 'BAD'} {name:<52} max abs err {err:.2e}")

    for model, (heads, kv_heads, head_dim) in models.items():
        for dtype in dtypes:
            tol = TOL[dtype]
            for block_size in (16, 32):
                tag = f"{model} {str(dtype)[6:]} bs{block_size}"
                for kind, seqs in (("decode", mixed), ("prefill", prefill)):
                    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, device,
                                       share_pages=1)
                    want = reference.paged_attention(*batch.args())
                    for split_keys in (0, 64):
                        got = triton_attention.paged_attention(*batch.args(), split_keys=split_keys)
                        report(f"{tag} {kind} split_keys={split_keys}", *compare(got, want, tol))
                    got = kernels.paged_attention(*batch.args())
                    report(f"{tag} {kind} default split", *compare(got, want, tol))

                batch = make_batch(mixed, heads, kv_heads, head_dim, block_size, dtype, device)
                t = batch.q.shape[0]
                k = torch.randn(t, kv_heads, head_dim, device=device).to(dtype)
                v = torch.randn(t, kv_heads, head_dim, device=device).to(dtype)
                slots = torch.randperm(batch.k_cache.shape[0] * block_size, device=device)[:t]
                slots[0] = -1
                got, want = [batch.k_cache.clone(), batch.v_cache.clone()], [batch.k_cache, batch.v_cache]
                kernels.write_kv(*got, k, v, slots)
                reference.write_kv(*want, k, v, slots)
                same = _same_bits(got, want)
                report(f"{tag} write_kv (bit-exact)", 0.0 if same else float("nan"), same)

    return ok


def _gathered_sdpa(batch: Batch, heads: int, kv_heads: int):
    """The baseline: gather each (equal-length) sequence's pages to contiguous K/V, then SDPA."""
    import torch.nn.functional as F

    bsz = batch.context_lens.shape[0]
    ctx = batch.max_context_len
    qlen = batch.max_query_len
    n_pages = math.ceil(ctx / batch.k_cache.shape[1])
    pages = batch.block_tables[:, :n_pages].long()
    q = batch.q.view(bsz, qlen, heads, -1).transpose(1, 2)
    # Causal with the queries at the end of the context (SDPA's is_causal aligns top-left).
    mask = None
    if qlen > 1:
        q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]

    def run():
        k = batch.k_cache[pages].flatten(1, 2)[:, :ctx].transpose(1, 2)
        v = batch.v_cache[pages].flatten(1, 2)[:, :ctx].transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale,
                                              enable_gqa=heads != kv_heads)

    return run


def _time_ms(fn, iters=50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def benchmark() -> None:
    from pagedchat import kernels

    cases = [  # (label, batch, context, query_len)
        ("decode", 1, 16384), ("decode", 8, 4096), ("decode", 64, 1024), ("decode", 256, 512),
        ("prefill chunk", 1, 4096), ("prefill chunk", 4, 2048),
    ]
    print(f"\n{'model':<14} {'dtype':<9} {'case':<14} {'B':>4} {'ctx':>6} {'q':>4} "
          f"{'triton ms':>10} {'gather+sdpa ms':>15} {'speedup':>8}")
    for model, (heads, kv_heads, head_dim) in MODELS.items():
        for dtype in (torch.float16, torch.bfloat16):
            for label, bsz, ctx in cases:
                qlen = 1 if label == "decode" else 512
                batch = make_batch([(ctx, qlen)] * bsz, heads, kv_heads, head_dim, 16, dtype, "cuda")
                ours = _time_ms(lambda: kernels.paged_attention(*batch.args()))
                base = _time_ms(_gathered_sdpa(batch, heads, kv_heads))
                print(f"{model:<14} {str(dtype)[6:]:<9} {label:<14} {bsz:>4} {ctx:>6} {qlen:>4} "
                      f"{ours:>10.3f} {base:>15.3f} {base / ours:>7.2f}x")


def main() -> int:
    from pagedchat.kernels import interpret_env, triton_available

    if not triton_available():
        print("no CUDA device (and TRITON_INTERPRET is not 1): skipping the Triton kernel checks")
        return 0
    if torch.cuda.is_available() and not interpret_env():
        print(f"checking Triton kernels on {torch.cuda.get_device_name()}")
        ok = check_correctness("cuda", MODELS, (torch.float16, torch.bfloat16), MIXED, PREFILL)
        if ok:
            benchmark()
    else:
        print("TRITON_INTERPRET=1: checking the kernels in the interpreter on tiny shapes")
        ok = check_correctness("cpu", TINY_MODELS, (torch.float32, torch.float16, torch.bfloat16),
                               TINY_MIXED, TINY_PREFILL)
    print("all kernels match their reference" if ok else "MISMATCH: see BAD lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
