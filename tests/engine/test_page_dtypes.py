"""Every page dtype (kernels/kv_pages.py, `kv_cache_dtype`) through the engine on a tiny random model: pages sized in
their dtype's bytes, copies that move every byte (an int8 row's scale included), and greedy tokens equal to
transformers' up to near-ties under forks, preemption, swapping and a shared system prompt.

The conftest keeps engines without a kv_cache_dtype on float32 pages (bit for bit with transformers, tested
throughout tests/engine/); here the others are named. bf16 and int8 pages change the keys and values a query
reads: the parity tolerance is the packed weights' (tests/parity.py, NEAR_TIE_PACKED), for int8 too.
"""

from __future__ import annotations

import pytest
import torch

from pagedchat import Engine, SamplingParams
from pagedchat.engine.chat_template import chat_prompt_ids
from pagedchat.engine.pages import CopyPlan
from pagedchat.kernels import kv_pages
from pagedchat.model.hf_config import ModelConfig
from parity import NEAR_TIE_PACKED, assert_same_greedy
from slow_cases import slow_after
from tiny_models import hf_greedy

KV_DTYPES = ["float32", "bfloat16", "int8"]
NO_EOS = [10**9]


def page_bytes(folder, kv: str) -> int:
    return kv_pages.token_bytes(ModelConfig.from_folder(folder), kv_pages.parse_kv_cache_dtype(kv)) * 16


def manual(folder, kv: str, **kwargs) -> Engine:
    return Engine(str(folder), autostart=False, kv_cache_dtype=kv, **kwargs)


def drain(engine: Engine, check=None) -> None:
    for _ in range(5000):
        if not engine.has_work():
            return
        engine.step()
        if check:
            check()
    raise AssertionError("the engine makes no progress")


def ids_of(tokenizer, n: int, salt: int = 0) -> list[int]:
    words = " ".join(f"fox {salt} jumps over dog {i}, paged blocks hold keys." for i in range(n))
    return tokenizer.encode(words)[:n]


def check_same(ref, prompt: list[int], ours: list[int], max_tokens: int) -> None:
    assert len(ours) == max_tokens
    assert_same_greedy(ref, prompt, ours, hf_greedy(ref, prompt, max_tokens, NO_EOS), near_tie=NEAR_TIE_PACKED)


def invariants(engine: Engine):
    return lambda: engine.pages.first.check_invariants([s.table(0).block_table for s in engine.scheduler.all_seqs()])


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_the_pool_holds_pages_of_its_dtype_in_their_bytes(tiny_llama, kv):
    """The same budget buys pages by the page dtype's bytes a token: bf16 twice float32's, int8 (codes and a
    4-byte scale per token and KV head) more again; the activations stay float32."""
    budget = 48 * page_bytes(tiny_llama, "float32")
    eng = manual(tiny_llama, kv, kv_cache_memory=budget, swap_space=0)
    dtype = kv_pages.parse_kv_cache_dtype(kv)
    cfg = eng.config
    assert eng.dtype == torch.float32 and eng.kv_dtype == dtype and eng.runner.kv_cache.dtype == dtype
    assert eng.runner.kv_cache.shape[-1] == cfg.head_dim + (4 if kv == "int8" else 0)
    assert eng.cache_plan.page_bytes == page_bytes(tiny_llama, kv)
    assert eng.pages.first.num_pages == budget // page_bytes(tiny_llama, kv)
    assert eng.runner.kv_cache[:, :, : eng.pages.first.num_pages].numel() * dtype.itemsize == \
        eng.pages.first.num_pages * eng.cache_plan.page_bytes
    assert {"float32": 48, "bfloat16": 96}.get(kv, eng.pages.first.num_pages) == eng.pages.first.num_pages
    if kv == "int8":
        assert eng.pages.first.num_pages == 48 * 4 * cfg.head_dim // (cfg.head_dim + 4)


def test_kv_cache_dtype_refuses_what_it_does_not_know(tiny_llama):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4': use one of auto, float32, bfloat16, int8"):
        Engine(str(tiny_llama), kv_cache_memory="1MiB", kv_cache_dtype="fp4")
    assert kv_pages.parse_kv_cache_dtype("BF16") is torch.bfloat16 and kv_pages.parse_kv_cache_dtype(None) is \
        kv_pages.AUTO


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_copies_keep_every_byte_of_a_page(tiny_llama, kv):
    """Swapping out to the CPU tier, back in, and copy on write move a page's bytes as they are: an int8 row's
    scale travels with its codes."""
    page = page_bytes(tiny_llama, kv)
    eng = manual(tiny_llama, kv, kv_cache_memory=8 * page, swap_space=2 * page)
    eng.submit(ids_of(eng.tokenizer, 40), SamplingParams(max_tokens=4, ignore_eos=True))
    drain(eng)
    runner = eng.runner
    pool = runner.kv_cache
    full = [p for p in range(eng.pages.first.num_pages) if pool[:, :, p].view(torch.uint8).count_nonzero()]
    empty = [p for p in range(eng.pages.first.num_pages) if p not in full]
    assert len(full) >= 2 and len(empty) >= 2
    source = full[0]
    original = pool[:, :, source].clone()
    runner.copy_pages((CopyPlan(swap_out=[(source, 1)]),))
    runner.copy_pages((CopyPlan(swap_in=[(1, empty[0])], cow=[(source, empty[1])]),))
    for copy in (runner.cpu_caches[0][:, :, 1], pool[:, :, empty[0]], pool[:, :, empty[1]]):
        assert torch.equal(copy.view(torch.uint8), original.view(torch.uint8))
    if kv == "int8":
        scales = original[..., -kv_pages.SCALE_BYTES:].contiguous().view(torch.float32)
        assert (scales > 0).any()


# The fast run keeps recompute on bf16 pages and swapping on int8 pages (whose scales travel with the page).
@pytest.mark.parametrize("kv,swap_pages", slow_after([("bfloat16", 0), ("int8", 32), ("bfloat16", 32), ("int8", 0)],
                                                     keep=2))
def test_preemption_and_swapping_keep_tokens(tiny_llama, tiny_llama_ref, kv, swap_pages):
    """Four chats outgrow an 8-page pool: preempted (swapped out, or dropped and recomputed), every output still
    transformers' up to near-ties."""
    page = page_bytes(tiny_llama, kv)
    eng = manual(tiny_llama, kv, kv_cache_memory=8 * page, swap_space=swap_pages * page)
    prompts = [ids_of(eng.tokenizer, n, salt=i) for i, n in enumerate((20, 9, 25, 14))]
    handles = eng.submit_many(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    drain(eng, check=invariants(eng))
    c = eng.pages.first.counters
    assert (c.swap_outs > 0 and c.swap_ins == c.swap_outs) if swap_pages else c.recomputes > 0
    for prompt, handle in zip(prompts, handles):
        check_same(tiny_llama_ref, prompt, handle.result().token_ids, 40)


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_a_fork_copies_its_partial_page_and_continues(tiny_llama, tiny_llama_ref, kv):
    eng = manual(tiny_llama, kv, kv_cache_memory="1MiB")
    prompt, reply = ids_of(eng.tokenizer, 40), []
    parent = eng.submit(prompt, SamplingParams(max_tokens=30, ignore_eos=True),
                        on_update=lambda u: reply.extend(u.token_ids))
    while len(reply) < 11:  # 51 tokens: the fork shares a partial page
        eng.step()
    history = prompt + reply
    child = eng.fork(parent.request_id, SamplingParams(max_tokens=20, ignore_eos=True))
    drain(eng, check=invariants(eng))
    assert eng.pages.first.counters.cow_copies == 1
    check_same(tiny_llama_ref, prompt, parent.result().token_ids, 30)
    check_same(tiny_llama_ref, history, child.result().token_ids, 20)


@pytest.mark.parametrize("kv", slow_after(["int8", "bfloat16"]))
def test_eight_chats_on_one_system_prompt(tiny_llama, tiny_llama_ref, kv):
    """The issue's target: 8 chats sharing a system prompt, its pages read by all, transformers' tokens up to
    near-ties."""
    eng = manual(tiny_llama, kv, kv_cache_memory="1MiB")
    system = eng.tokenizer.decode(ids_of(eng.tokenizer, 200))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}: what is {i}?"}]
             for i in range(8)]
    handles = eng.submit_many(chats, SamplingParams(max_tokens=12, ignore_eos=True))
    drain(eng, check=invariants(eng))
    results = [h.result() for h in handles]
    assert sum(r.cached_tokens for r in results) >= 7 * 192
    for chat, result in zip(chats, results):
        check_same(tiny_llama_ref, chat_prompt_ids(eng.tokenizer, chat), result.token_ids, 12)
