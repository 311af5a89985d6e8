"""Weights and KV pages in huge pages (pagedchat/model/hugepages.py): the packed-weights cache's reader gives
safetensors' own tensors, its large ones in mappings advised for huge pages, and falls back to small pages where
the advice is refused or unknown."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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


def huge_page_advised(t: torch.Tensor) -> bool:
    """Whether the mapping that holds t is eligible for transparent huge pages (smaps' THPeligible)."""
    address = t.data_ptr()
    eligible, inside = None, False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            eligible = line.split()[1] == "1"
    return bool(eligible)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


def test_read_gives_safetensors_tensors_large_ones_in_huge_pages(tmp_path):
    path = write(tmp_path / "w.safetensors")
    got, meta = hugepages.read_safetensors(path)
    assert_same(got, load_file(str(path)))
    assert meta == {"forms": "{}"}
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not SMAPS.exists() or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here")
    assert huge_page_advised(got["big"])


@pytest.mark.parametrize("advice", ["refused", "unknown"])
def test_read_falls_back_to_small_pages(tmp_path, monkeypatch, advice):
    """A kernel without transparent huge pages refuses the advice (EINVAL); a platform without it has no
    MADV_HUGEPAGE: either way the tensors are read whole."""
    if advice == "refused":
        monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)
    else:
        monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    path = write(tmp_path / "w.safetensors")
    got, _ = hugepages.read_safetensors(path)
    assert_same(got, load_file(str(path)))


def test_a_cut_file_is_an_error(tmp_path):
    path = write(tmp_path / "w.safetensors")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="ends inside tensor"):
        hugepages.read_safetensors(path)
