"""The kernels' parallel loops split their work by rows, heads and panels, never a row's sums: how many threads
run them, and which runs what, must never change a result's bits (docs/architecture.md#same-request-same-tokens)."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedchat.model import qmm
from test_qmm import LEVELS, random_blocks

THREADS = (1, 2, 3, 5)   # more threads than this machine's cores too


@pytest.fixture
def threads():
    """torch.set_num_threads for this test only."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def at_each_count(threads, op) -> list:
    results = []
    for count in THREADS:
        threads(count)
        results.append(op())
    return results


def same_bits(results: list) -> None:
    first = results[0]
    for count, other in zip(THREADS[1:], results[1:]):
        assert torch.equal(first, other), f"{count} threads"


@pytest.mark.parametrize("each_level", LEVELS, indirect=True)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_layers_ops_give_the_same_bits_at_every_thread_count(each_level, threads, rows):
    gen = torch.Generator().manual_seed(rows)
    kinds = ["Q4_1", "Q8_0", "Q6_K"]
    weights = [qmm.pack(torch.from_numpy(random_blocks(kind, n, 512, seed=n)), kind)
               for kind, n in zip(kinds, (1152, 128, 4864))]
    x = torch.randn(rows, 512, generator=gen)
    w = torch.rand(512, generator=gen) + 0.5
    gate_up = torch.randn(rows, 2 * 4864, generator=gen)
    same_bits(at_each_count(threads, lambda: qmm.matmul_cat(x, weights, kinds)))
    same_bits(at_each_count(threads, lambda: qmm.norm(x, w, 1e-6)))
    same_bits(at_each_count(threads, lambda: qmm.silu_mul(gate_up)))
    same_bits(at_each_count(threads, lambda: qmm.argmax_rows(gate_up)))


@pytest.mark.parametrize("each_level", LEVELS, indirect=True)
# Nine sequences; then one and two with SmolLM2-135M's groups, where a group's query heads are split among the
# threads, and so among more of them at each count.
@pytest.mark.parametrize("batch, heads, kv_heads", [(9, 8, 2), (1, 9, 3), (2, 9, 3)])
def test_attention_from_the_pages_gives_the_same_bits_at_every_thread_count(each_level, threads, batch, heads,
                                                                            kv_heads):
    gen = torch.Generator().manual_seed(0)
    d, block, pages = 64, 16, 40
    q = torch.randn(batch, heads, d, generator=gen)
    k_cache = torch.randn(pages, block, kv_heads, d, generator=gen)
    v_cache = torch.randn(pages, block, kv_heads, d, generator=gen)
    tables = torch.randperm(pages, generator=gen)[:batch * 4].view(batch, 4).to(torch.int32)
    lens = torch.randint(1, 4 * block, (batch,), generator=gen, dtype=torch.int32)
    same_bits(at_each_count(threads, lambda: qmm.attend(q, k_cache, v_cache, tables, lens, d ** -0.5, 0)))


@pytest.mark.parametrize("each_level", LEVELS[:1], indirect=True)
def test_loops_called_from_two_threads_at_once_each_get_their_own_result(each_level, threads):
    """The pool serves one loop at a time; a loop that finds it busy runs on its caller's thread alone."""
    kind = "Q4_1"
    weight = qmm.pack(torch.from_numpy(random_blocks(kind, 2048, 512, seed=3)), kind)
    xs = [torch.randn(3, 512, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    threads(1)
    expected = [qmm.matmul(x, weight, kind) for x in xs]
    got: list = [[], []]

    def run(i: int) -> None:
        torch.set_num_threads(2)   # per calling thread
        got[i] = [qmm.matmul(xs[i], weight, kind) for _ in range(200)]

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for i in range(2):
        assert all(torch.equal(y, expected[i]) for y in got[i])
