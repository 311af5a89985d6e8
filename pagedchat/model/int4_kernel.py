"""pagedchat's own int4 matmul for batched rows (int4_mm.cpp), compiled once per machine; torch's kernel is the
fallback wherever it is not built.

torch's `_weight_int4pack_mm_for_cpu` unpacks and scales each weight tile again for every 4 rows, so a step of
8 or 16 chats pays for the unpacking several times over. int4_mm.cpp reads the same packed tensors, dequantizes
each tile once per call and multiplies every row against it (docs/bench.md, "pagedchat's int4 kernel for
batched steps"). Below MIN_ROWS torch's kernel is as fast, and from quant.DENSE_MIN_ROWS the dense path takes
over.

The library is built with the machine's C++ compiler against the installed torch with -march=native, into the
cache folder, under a name keyed by the source, torch and the CPU. `pagedchat pull` builds it. An engine that
finds it missing starts the build in a background process and runs on torch's kernel until the library loads.
Without AVX-512 or without a compiler torch's kernel serves. PAGEDCHAT_INT4_KERNEL=0 turns the int4 path off
where pagedchat's block kernels run (linear.Placement), and leaves torch's kernel where they do not.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pagedchat import interpreter, paths
from pagedchat.model.qmm import NO_COMPILER, compiler, failure_path

MIN_ROWS = 8
BLOCK = 64  # output channels per packed tile: torch's layout with AVX-512, the one int4_mm.cpp reads
ENV = "PAGEDCHAT_INT4_KERNEL"  # "0" keeps torch's kernel
SOURCE = Path(__file__).with_name("int4_mm.cpp")
NEEDED_FLAGS = ("avx512f", "avx512bw")


@dataclass
class State:
    op: Callable | None = None
    why_not: str = "not loaded yet"
    started: threading.Lock = field(default_factory=threading.Lock)  # held once the background load began


_state = State()
_lock = threading.Lock()
log = logging.getLogger(__name__)


def op() -> Callable | None:
    """The kernel, once loaded in this process; None until then (and where it cannot be)."""
    return _state.op


def describe() -> str:
    """What batched int4 matmuls run on here, for logs and the bench's header."""
    if _state.op is not None:
        return f"pagedchat's AVX-512 int4 kernel from {MIN_ROWS} rows"
    return f"torch's int4 kernel ({_state.why_not})"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags, read once: both the check and the library's name need them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def unavailable() -> str | None:
    """Why the kernel cannot serve here, or None where it can be built."""
    if os.environ.get(ENV, "1") == "0":
        return f"off: {ENV}=0"
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return "built for x86-64 Linux only"
    missing = [f for f in NEEDED_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if compiler() is None:
        return NO_COMPILER
    return None


def library_path() -> Path:
    """Where this machine's build lives: -march=native code is only valid on the CPU it was built for."""
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), flags.encode(),
                                     platform.python_implementation().encode()])).hexdigest()[:16]
    return paths.cache_dir() / "kernels" / f"int4_mm-{key}.so"


def build_command(source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline OpenMP; the library then needs libgomp.so.1, which torch has loaded.
    return [compiler(), "-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()),
            str(source), "-o", str(target), *(f"-L{p}" for p in cpp_extension.library_paths()),
            "-lc10", "-ltorch_cpu", "-ltorch"]


def build(target: Path) -> None:
    """Compile into target, atomically: a reader sees no library or a whole one. On failure, raises and leaves
    the compiler's message in failure_path(target)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        out = Path(work) / target.name
        result = subprocess.run(build_command(SOURCE, out), capture_output=True, text=True,
                                stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            failure_path(target).write_text(f"compiling {SOURCE.name} failed:\n{result.stderr[-4000:]}")
            raise RuntimeError(f"compiling {SOURCE.name} failed (see {failure_path(target)})")
        os.replace(out, target)


def _load_library(path: Path) -> None:
    try:
        torch.ops.load_library(str(path))
        _state.op = torch.ops.pagedchat.int4_mm
    except (OSError, RuntimeError) as e:  # a library left by another torch, say: torch's kernel serves
        _state.why_not = f"could not load {path.name}: {e}"


def ensure(wait: bool) -> str | None:
    """Load the kernel, building it first if this machine has none. wait: here and now, returning why it is
    not loaded (None once it is). Otherwise on a thread of its own, the build in a separate process, so that a
    starting engine loses no time: batched steps take the kernel from the moment it is loaded."""
    if not wait:
        if _state.started.acquire(blocking=False):  # once per process
            threading.Thread(target=_ensure, args=(False,), daemon=True, name="pagedchat-int4-kernel").start()
        return None
    return _ensure(True)


def _ensure(here: bool) -> str | None:
    with _lock:  # one build at a time: a caller that waits waits for the background's
        if _state.op is not None:
            return None
        why = unavailable()
        if why is None:
            why = _build_and_load(library_path(), here)
            if why is not None:  # it should have served here: say why in the log (the engine's, in the app)
                log.warning("pagedchat's int4 kernel is not used, torch's serves: %s", why)
        _state.why_not = why or ""
        if why is None:
            _state.started.acquire(blocking=False)  # loaded: a later ensure(wait=False) has nothing to start
        return why


def _build_and_load(path: Path, here: bool) -> str | None:
    if failure_path(path).exists():
        return f"it did not compile here (see {failure_path(path)})"
    if not path.exists():
        try:
            build(path) if here else _build_elsewhere(path)
        except (OSError, RuntimeError) as e:
            return str(e)
    _load_library(path)
    return None if _state.op is not None else _state.why_not


def _build_elsewhere(path: Path) -> None:
    """build(path) in a separate interpreter at low priority (build_niced): the compiler's seconds of CPU must
    not slow the engine's steps."""
    result = subprocess.run(interpreter.command(__name__, "build_niced", str(path)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise RuntimeError((result.stderr.strip().splitlines() or ["the build failed"])[-1])


def build_niced(target: str) -> None:
    """The background build's process: build(target) at nice 10; a failure's reason is its last line."""
    os.nice(10)
    try:
        build(Path(target))
    except (OSError, RuntimeError) as e:
        sys.exit(str(e))
