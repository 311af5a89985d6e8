"""The rules pagedchat's C++ kernels are built by (pagedchat/model/csrc/qmm.h): one table per list, and no function
with vague linkage in a level's code, whose one copy the linker would keep for every level."""

from __future__ import annotations

import shutil
import subprocess

import gguf
import pytest

from pagedchat.model import qmm
from slow_cases import slow_after


def test_the_type_table_holds_ggmls_ids():
    assert qmm.TYPES == {name: int(gguf.GGMLQuantizationType[name]) for name in qmm.TYPES}
    assert list(qmm.TYPES) == ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def test_the_level_table_gives_each_level_its_bases_flags():
    by_name = {lv.name: lv for lv in qmm.LEVELS}
    assert [lv.name for lv in qmm.LEVELS] == ["amx", "avx512-vnni", "avx512", "avx2-vnni", "avx2", "portable"]
    assert by_name["portable"].flags == () and qmm.PORTABLE is by_name["portable"]
    assert by_name["avx2"].flags == ("-mavx2", "-mfma", "-mf16c")
    assert by_name["amx"].flags == (*by_name["avx512-vnni"].flags, "-mamx-tile", "-mamx-int8")
    assert by_name["avx2-vnni"].flags == (*by_name["avx2"].flags, "-mavxvnni")
    assert by_name["avx512-vnni"].symbol == "avx512_vnni"


def test_the_librarys_levels_follow_the_table():
    if qmm.ensure() is not None and not qmm.runnable():
        pytest.skip("pagedchat's kernels are not built here")
    names = [lv.name for lv in qmm.LEVELS]
    assert qmm.runnable()[-1] == "portable"
    assert sorted(qmm.runnable(), key=names.index) == list(qmm.runnable())


# Not a level's code: the pointer to the C++ runtime's unwinding routine, the same in every object that has a
# landing pad (an unoptimized build keeps pads that only end locals' lifetimes, where the optimized one has none).
PERSONALITY = "DW.ref.__gxx_personality_v0"


# The quick run builds the widest level, whose objects hold the most of qmm.h's code; the full run every level.
@pytest.mark.parametrize("level", slow_after(qmm.levels_to_build()), ids=lambda lv: lv.name)
def test_no_level_object_defines_a_symbol_the_linker_merges(tmp_path, level):
    """A level's objects, built without optimization (where no inline function is inlined away), define no
    weak, vague-linkage or unique symbol: the inline rule of qmm.h."""
    if qmm.unavailable() is not None or shutil.which("nm") is None:
        pytest.skip(qmm.unavailable() or "no nm on PATH")
    jobs = {}
    for source in qmm.LEVEL_SOURCES:
        out = tmp_path / f"{level.name}-{source.stem}.o"
        command = ["-O0" if arg == "-O3" else arg for arg in qmm.level_command(level, source, out)]
        jobs[out] = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    merged = {}
    for out, job in jobs.items():
        assert job.wait() == 0, job.stderr.read()
        symbols = subprocess.run(["nm", "--defined-only", "-C", str(out)], capture_output=True, text=True,
                                 check=True).stdout.splitlines()
        shared = [line for line in symbols if line.split(" ", 2)[1] in "WVu" and not line.endswith(PERSONALITY)]
        if shared:
            merged[out.name] = shared
    assert merged == {}
