"""Weights and KV pages in huge pages (pagedchat/model/hugepages.py): the packed-weights cache's reader gives
safetensors' own tensors, its large ones in mappings advised for huge pages, and falls back to small pages where
the advice is refused or unknown."""

from __future__ import annotations

import errno
import gc
import mmap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedchat.engine.engine import Engine
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.pool_warmer import PoolWarmer
from pagedchat.model import hugepages

SMAPS = Path("/proc/self/smaps")


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        # over two huge pages: a whole aligned one lies inside the mapping wherever it starts
        "big": torch.randint(0, 256, (4, hugepages.HUGE_PAGE // 2 + 5), generator=gen, dtype=torch.uint8),
        "norm": torch.randn(7, generator=gen),
        "scales": torch.randn(4, 6, generator=gen).to(torch.bfloat16),
        "codes": torch.randint(-9, 9, (5,), generator=gen, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
    }


def write(path: Path) -> Path:
    save_file(tensors(), str(path), metadata={"forms": "{}"})
    return path


def mapping(address: int) -> dict[str, str]:
    """smaps' fields of the mapping that holds address (its first value each)."""
    fields, inside = {}, False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            fields[head.rstrip(":")] = line.split()[1]
    return fields


def huge_page_advised(t: torch.Tensor) -> bool:
    """Whether the mapping that holds t is eligible for transparent huge pages (smaps' THPeligible)."""
    return mapping(t.data_ptr()).get("THPeligible") == "1"


def resident(t: torch.Tensor) -> int:
    """Bytes of the mapping that holds t in memory (smaps' Rss)."""
    return int(mapping(t.data_ptr())["Rss"]) * 1024


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


def huge_pages_here() -> bool:
    thp = hugepages.THP_SWITCH
    return SMAPS.exists() and thp.exists() and "[never]" not in thp.read_text()


def in_huge_pages(t: torch.Tensor) -> int:
    """Bytes of the mapping that holds t in huge pages (smaps' AnonHugePages)."""
    return int(mapping(t.data_ptr())["AnonHugePages"]) * 1024


def test_read_gives_safetensors_tensors_large_ones_in_huge_pages(tmp_path, monkeypatch):
    """Where the kernel cannot collapse small pages later, the large tensors' mappings are advised for huge
    pages before they are read."""
    monkeypatch.setattr(hugepages, "can_collapse", lambda: False)
    path = write(tmp_path / "w.safetensors")
    got, meta, later = hugepages.read_safetensors(path)
    assert_same(got, load_file(str(path)))
    assert meta == {"forms": "{}"} and later is None
    if not huge_pages_here():
        pytest.skip("no transparent huge pages here")
    assert huge_page_advised(got["big"])


def test_read_into_small_pages_then_collapsed_keeps_every_byte(tmp_path):
    """Where the kernel can (MADV_COLLAPSE), the large tensors are read into small pages, quick to hand out,
    and the Collapser turns their whole huge pages into huge ones, contents kept."""
    if not huge_pages_here() or not hugepages.can_collapse():
        pytest.skip("no MADV_COLLAPSE here")
    path = write(tmp_path / "w.safetensors")
    got, _, later = hugepages.read_safetensors(path)
    assert later is not None and in_huge_pages(got["big"]) == 0
    calls = 0
    while later.collapse_some():
        calls += 1
    assert calls >= 1 and not later.collapse_some()
    assert in_huge_pages(got["big"]) >= hugepages.HUGE_PAGE
    assert_same(got, load_file(str(path)))


def test_huge_pages_switched_off_are_not_collapsed_into(monkeypatch, tmp_path):
    """`transparent_hugepage` set to never: MADV_COLLAPSE would ignore it, so nothing is collapsed."""
    switch = tmp_path / "enabled"
    switch.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_SWITCH", switch)
    hugepages.can_collapse.cache_clear()
    try:
        assert not hugepages.can_collapse()
    finally:
        hugepages.can_collapse.cache_clear()


def test_a_refused_collapse_leaves_the_rest_to_the_kernels_own_thread(monkeypatch):
    """A collapse the kernel refuses (no huge page free, say) ends the Collapser's work: what is left is advised
    for huge pages instead, and the contents stay."""
    if not huge_pages_here():
        pytest.skip("no transparent huge pages here")
    monkeypatch.setattr(hugepages, "MADV_COLLAPSE", 0x7FFF)  # an advice no kernel knows: EINVAL
    memory = hugepages.anonymous(3 * hugepages.HUGE_PAGE, huge=False)
    memory[::4096] = 9
    collapser = hugepages.Collapser([memory])
    assert not huge_page_advised(memory)
    assert not collapser.collapse_some() and not collapser.collapse_some()
    assert huge_page_advised(memory) and int(memory.sum()) == 9 * len(range(0, memory.numel(), 4096))


@pytest.mark.parametrize("refusals", [1, hugepages.COLLAPSE_TRIES])
def test_a_transient_refusal_is_tried_again_a_few_times(monkeypatch, refusals):
    """EAGAIN (a page locked or in flight) failed the whole Collapser at once, and an engine always busy lost its
    huge pages for good: the range is now tried again at the next call, until refused a few times in a row."""
    if not huge_pages_here() or not hugepages.can_collapse():
        pytest.skip("no MADV_COLLAPSE here")
    collapse, calls = hugepages._collapse, []

    def flaky(start: int, nbytes: int) -> int:
        calls.append(start)
        return errno.EAGAIN if len(calls) <= refusals else collapse(start, nbytes)

    monkeypatch.setattr(hugepages, "_collapse", flaky)
    memory = hugepages.anonymous(3 * hugepages.HUGE_PAGE, huge=False)
    memory.fill_(7)
    collapser = hugepages.Collapser([memory])
    outcomes = [collapser.collapse_some(hugepages.HUGE_PAGE) for _ in range(refusals + 1)]
    if refusals < hugepages.COLLAPSE_TRIES:
        assert outcomes == [True] * (refusals + 1) and len(set(calls)) == 1   # the same range again
        assert in_huge_pages(memory) == hugepages.HUGE_PAGE and not huge_page_advised(memory)
    else:
        assert outcomes == [True] * (refusals - 1) + [False, False] and len(calls) == refusals
        assert in_huge_pages(memory) == 0 and huge_page_advised(memory)
    assert int(memory.min()) == 7


@pytest.mark.parametrize("advice", ["refused", "unknown"])
def test_read_falls_back_to_small_pages(tmp_path, monkeypatch, advice):
    """A kernel without transparent huge pages refuses the advice (EINVAL); a platform without it has no
    MADV_HUGEPAGE: either way the tensors are read whole."""
    if advice == "refused":
        monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    else:
        monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    path = write(tmp_path / "w.safetensors")
    got, _, _ = hugepages.read_safetensors(path)
    assert_same(got, load_file(str(path)))


def test_a_cut_file_is_an_error(tmp_path):
    path = write(tmp_path / "w.safetensors")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="ends inside tensor"):
        hugepages.read_safetensors(path)


def populating() -> bool:
    """Whether this OS faults memory in on request (Linux 5.14 and later); where not, populate says so."""
    probe = hugepages.anonymous(hugepages.SMALL_PAGE)
    return hugepages.populate(probe.data_ptr(), probe.numel())


def test_populate_faults_memory_in_and_keeps_what_it_holds():
    if not SMAPS.exists() or not populating():
        pytest.skip("no MADV_POPULATE_WRITE here")
    memory = hugepages.anonymous(4 * hugepages.HUGE_PAGE)
    memory[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    before = resident(memory)
    assert hugepages.populate(memory.data_ptr() + 7, 3 * hugepages.HUGE_PAGE)
    assert resident(memory) >= before + 2 * hugepages.HUGE_PAGE
    assert memory[:5].tolist() == [1, 2, 3, 4, 5] and not memory[5:].any()


def pool(layers: int, pages: int, page_bytes: int) -> torch.Tensor:
    """A KV pool as the model runner makes it: [layers, 2, pages, page bytes] of lazily zeroed memory."""
    return hugepages.anonymous(layers * 2 * pages * page_bytes).view(layers, 2, pages, page_bytes)


def warm_all(warmer: PoolWarmer) -> int:
    calls = 0
    while warmer.warm_some():
        calls += 1
    return calls


def test_the_warmer_faults_in_the_pages_past_the_last_written_a_region_at_a_time():
    """Every layer's keys and values: first the pages of one huge page from the pool's start, then, once a step
    wrote page p, those up to a huge page past it; one region per call, contents kept."""
    if not SMAPS.exists() or not populating():
        pytest.skip("no MADV_POPULATE_WRITE here")
    page_bytes = 64 * 1024
    kv = pool(layers=3, pages=200, page_bytes=page_bytes)
    kv[1, 1, 0, :4] = 7  # a step's write: the warmer keeps it
    warmer = PoolWarmer(kv)
    ahead = hugepages.HUGE_PAGE // page_bytes
    assert (warmer.wanted, warmer.warmed) == (ahead, 0)
    assert warm_all(warmer) == 6 and warmer.warmed == ahead
    warmer.written(40)
    assert warm_all(warmer) == 2 * 6 and warmer.warmed == 40 + 1 + ahead  # at most a huge page a call
    assert resident(kv) >= 6 * warmer.warmed * page_bytes
    warmer.written(199)  # the pool's end bounds it
    warm_all(warmer)
    assert warmer.warmed == 200 and not warmer.warm_some()
    assert kv[1, 1, 0, :4].tolist() == [7] * 4 and int(kv.sum()) == 7 * 4


def test_without_the_os_call_the_warmer_stops_and_steps_fault_in_themselves(monkeypatch):
    monkeypatch.setattr(hugepages, "populate", lambda address, nbytes: False)
    warmer = PoolWarmer(pool(layers=2, pages=10, page_bytes=4096))
    assert not warmer.warm_some() and not warmer.supported and warmer.warmed == 0


def test_an_idle_engine_warms_its_pool_before_a_request_and_past_what_replies_wrote(tiny_llama):
    if not populating():
        pytest.skip("no MADV_POPULATE_WRITE here")
    engine = Engine(str(tiny_llama), kv_cache_memory="256MiB")
    try:
        warmer = engine.runner.warmers[0]
        assert warmer.ahead < warmer.num_pages

        def settled() -> int:
            deadline = time.monotonic() + 30
            while warmer.warmed < warmer.wanted and time.monotonic() < deadline:
                time.sleep(0.02)
            return warmer.warmed

        assert settled() == warmer.ahead  # before any request: the pool's first huge page in every region
        engine.generate([list(range(3, 40))], SamplingParams(max_tokens=60, ignore_eos=True))
        last = (37 + 59 - 1) // engine.block_size  # the reply's last token is sampled, never written
        assert settled() == last + 1 + warmer.ahead
    finally:
        engine.shutdown()


def test_an_idle_engine_collapses_its_weights_into_huge_pages(tiny_llama):
    """The engine's idle turns take the weights' Collapser first: weights read into small pages (a tiny model's
    are too small, so a stand-in of three huge pages is handed to it) are in huge pages once a reply is done."""
    if not huge_pages_here() or not hugepages.can_collapse():
        pytest.skip("no MADV_COLLAPSE here")
    engine = Engine(str(tiny_llama), kv_cache_memory="8MiB")
    try:
        weights = hugepages.anonymous(3 * hugepages.HUGE_PAGE, huge=False)
        weights.fill_(5)
        engine.model.huge_pages = hugepages.Collapser([weights])
        engine.generate([list(range(3, 20))], SamplingParams(max_tokens=4, ignore_eos=True))
        deadline = time.monotonic() + 30
        while in_huge_pages(weights) < 2 * hugepages.HUGE_PAGE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert in_huge_pages(weights) >= 2 * hugepages.HUGE_PAGE and int(weights.min()) == 5
    finally:
        engine.shutdown()


def test_an_engine_that_is_never_idle_collapses_a_huge_page_a_step(tiny_llama, monkeypatch):
    """Stepped by hand, an engine has no idle turns: each step collapses one huge page before its forward pass,
    so a server that is always busy still gets its weights into huge pages."""
    if not huge_pages_here() or not hugepages.can_collapse():
        pytest.skip("no MADV_COLLAPSE here")
    collapse, refusals = hugepages._collapse, []

    def recorded(start: int, nbytes: int) -> int:
        refusals.append(collapse(start, nbytes))
        return refusals[-1]

    monkeypatch.setattr(hugepages, "_collapse", recorded)
    engine = Engine(str(tiny_llama), kv_cache_memory="8MiB", autostart=False)
    try:
        weights = hugepages.anonymous(4 * hugepages.HUGE_PAGE, huge=False)
        weights.fill_(5)
        engine.model.huge_pages = hugepages.Collapser([weights])  # three whole huge pages at least
        engine.submit(list(range(3, 20)), SamplingParams(max_tokens=16, ignore_eos=True))
        collapsed = [in_huge_pages(weights)]
        for _ in range(3 + hugepages.COLLAPSE_TRIES):  # room for a transient refusal or two
            engine.step()
            collapsed.append(in_huge_pages(weights))
        tries = hugepages.COLLAPSE_TRIES
        given_up = any(r not in (0, errno.EAGAIN) for r in refusals) or refusals[-tries:] == [errno.EAGAIN] * tries
        if collapsed[-1] < 3 * hugepages.HUGE_PAGE and given_up:
            pytest.skip(f"the kernel refused collapses ({refusals}): no huge page free, say")
        assert all(0 <= b - a <= hugepages.HUGE_PAGE for a, b in zip(collapsed, collapsed[1:])), collapsed
        assert collapsed[-1] >= 3 * hugepages.HUGE_PAGE and int(weights.min()) == 5
    finally:
        engine.shutdown()


def test_an_engine_dropped_without_shutdown_still_ends_its_thread(tiny_llama):
    """An engine that never ran a request: the warming job it starts with is its own method, and once the job is
    done the waiting compute thread must not keep the engine alive, whose finalizer closes the thread."""
    engine = Engine(str(tiny_llama), kv_cache_memory="8MiB")
    thread = engine._compute._thread
    del engine
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:  # the job holds the engine until it returns
        gc.collect()
        thread.join(timeout=0.1)
    assert not thread.is_alive()


def test_an_empty_pool_has_nothing_to_warm():
    warmer = PoolWarmer(torch.zeros(2, 2, 0, 16, 4))
    assert warmer.wanted == 0 and not warmer.warm_some()
