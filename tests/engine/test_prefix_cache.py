"""The prefix cache alone: the hash index, a run of cached pages across the tiers, and matches inside a page
(prefix_cache.py)."""

from __future__ import annotations

import pytest

from fake_engine import toks
from pagedchat.engine.checks import PoolCorrupted
from pagedchat.engine.cpu_tier import CpuTier
from pagedchat.engine.page_pool import PagePool
from pagedchat.engine.pages import chain_hashes, page_hash
from pagedchat.engine.prefix_cache import PrefixCache

BS = 4


def cache(num_pages: int = 8, cpu_pages: int = 0) -> PrefixCache:
    return PrefixCache(PagePool(num_pages), BS, CpuTier(cpu_pages))


def test_publish_indexes_a_page_by_hash_and_parent_and_unpublish_forgets_it():
    c = cache()
    tokens = toks(3 * BS)
    hashes = chain_hashes(tokens, BS, 3)
    for i in range(3):
        c.publish(i, hashes, i, tokens)
    assert [c.page_of(h) for h in hashes] == [0, 1, 2]
    assert c.pool.pages[1].parent == hashes[0] and c.pool.pages[1].tokens == tuple(tokens[BS:2 * BS])
    assert c.children == {None: {0}, hashes[0]: {1}, hashes[1]: {2}}
    c.check()
    assert c.unpublish(1) == hashes[1]
    assert c.page_of(hashes[1]) is None and hashes[0] not in c.children
    assert c.pool.pages[1].hash is c.pool.pages[1].tokens is None
    c.check()


def test_a_run_takes_gpu_pages_then_cpu_pages_and_stops_at_a_gap():
    c = cache(cpu_pages=4)
    tokens = toks(5 * BS)
    hashes = chain_hashes(tokens, BS, 5)
    c.publish(6, hashes, 0, tokens)
    c.publish(7, hashes, 1, tokens)
    cpu_pages = [c.cpu.offload(hashes[2]), c.cpu.offload(hashes[4])]  # hashes[3] is cached nowhere
    assert c.run(hashes, 0, 5) == ([6, 7], [cpu_pages[0]])
    assert c.run(hashes, 1, 2) == ([7], [])
    assert c.run(hashes, 4, 5) == ([], [cpu_pages[1]])
    c.publish(5, hashes, 2, tokens)  # block 2 back on the GPU while its CPU copy is still cached
    assert c.run(hashes, 0, 5) == ([6, 7, 5], []), "the GPU copy serves it"
    c.unpublish(5)
    c.publish(4, hashes, 3, tokens)
    assert c.run(hashes, 0, 5) == ([6, 7], [cpu_pages[0]]), "a GPU page after a CPU one ends the run"


def test_partial_picks_the_longest_match_after_the_parent_and_prefers_written_pages():
    c = cache()
    prompt = toks(BS) + [1, 2, 3, 9]
    hashes = chain_hashes(prompt, BS, 1)
    near = toks(BS) + [1, 2, 7, 7]
    far = toks(BS) + [1, 7, 7, 7]
    c.publish(3, chain_hashes(near, BS, 2), 1, near)
    c.publish(4, chain_hashes(far, BS, 2), 1, far)
    assert c.partial(hashes[0], prompt[BS:]) == (3, 2)
    assert not c.written(3), "published this step: its forward pass writes it"
    c.end_step()
    assert c.written(3) and c.partial(hashes[0], prompt[BS:]) == (3, 2)
    assert c.partial(None, prompt[BS:]) == (None, 0), "no page follows the root with those tokens"
    assert c.partial(hashes[0], []) == (None, 0)
    tie = toks(BS) + [1, 2, 8, 8]
    c.publish(6, chain_hashes(tie, BS, 2), 1, tie)
    assert c.partial(hashes[0], prompt[BS:]) == (3, 2), "of equal matches, the page already written"
    c.publish(5, chain_hashes(prompt, BS, 2), 1, prompt)
    assert c.partial(hashes[0], prompt[BS:]) == (5, 4) and not c.written(5), "the longest, though written this step"
    c.end_step()
    assert c.written(5) and c.partial(hashes[0], prompt[BS:]) == (5, 4)


def test_recent_lookups_keep_the_last_64():
    c = cache()
    for i in range(70):
        c.record_lookup(10, i)
    assert len(c.recent_lookups) == 64 and c.recent_lookups[0] == (10, 6)


@pytest.mark.parametrize("corrupt, message", [
    (lambda c: setattr(c.pool.pages[0], "hash", 1), "lost its hash"),
    (lambda c: c.children[None].add(5), "differs from the cache"),
    (lambda c: setattr(c.pool.pages[0], "parent", 2), "another parent"),
])
def test_check_finds_a_broken_invariant(corrupt, message):
    c = cache()
    tokens = toks(BS)
    c.publish(0, chain_hashes(tokens, BS, 1), 0, tokens)
    c.check()
    corrupt(c)
    with pytest.raises(PoolCorrupted, match=message):
        c.check()


def test_contents_that_pythons_hash_confuses_get_distinct_page_hashes():
    """Python's hash of an int is the int modulo 2**61 - 1, so (parent, tokens) tuples collide on demand: the
    chain hash must not (a collision would map one prompt's pages, another's KV, for a different prompt)."""
    far = 2**61 - 1
    for a, b in [((None, (5, 6)), (None, (5 + far, 6))), ((7, (1, 2)), (7 + far, (1, 2)))]:
        assert hash(a) == hash(b)   # the forced collision
        assert page_hash(*a) != page_hash(*b)
    # And a chain: the same page after different prefixes is a different page.
    first, second = toks(2 * BS), toks(2 * BS)
    second[0] += 1
    assert chain_hashes(first, BS, 2)[1] != chain_hashes(second, BS, 2)[1]
    assert chain_hashes(first, BS, 2) == chain_hashes(list(first), BS, 2)
