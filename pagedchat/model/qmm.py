"""pagedchat's quantized matmuls: a GGUF's weights run from their own blocks (csrc/), compiled once per machine.

Every quantized type of a typical download (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stays as the file's
blocks, reordered at load into panels of 16 rows (pack; csrc/qmm.h), so the weights take the file's size in
memory. Each call quantizes its activation rows to int8 per 32 inputs (per 256 for K types on the AVX2 level:
activation_group) and takes integer dot products against the blocks, as llama.cpp's CPU kernels do
(docs/kernels.md#quantized-weights-on-the-cpu). The same library holds the rest of a decode step's kernels on the
CPU (csrc/layer_level.cpp): attention straight from the pages, and a float32 step's norms, rotary turn with the
cache write, and silu(gate) * up.

One library holds several instruction-set levels, the same sources compiled with each one's flags, and the
level is picked at run time from what the CPU runs: AMX (AVX-512 VNNI with AMX tiles for batches of 16 rows and
more, the same bits as AVX-512 VNNI), AVX-512 with VNNI, AVX-512, AVX2 with AVX-VNNI, AVX2, and portable C++ for
any other CPU (ARM included). PAGEDCHAT_KERNEL names a level to force one (a lower one than the
CPU's, to test or measure it), "off" to run torch's paths instead, or "auto" (the default, as unset).

The library is built with the machine's C++ compiler against the installed torch, into the cache folder, under
a name keyed by the sources, torch and the machine's architecture. `pagedchat pull` builds it, and so does the
first engine that finds none (about as long as `pull` takes for it). A build that failed leaves the compiler's
message beside the library's name and is not tried again. Without a compiler, torch's paths serve.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedchat import paths

ENV = "PAGEDCHAT_KERNEL"  # a level's name, "off", or "auto" (the default: the best level this CPU runs)
CSRC = Path(__file__).with_name("csrc")
# Each level is these sources built with its flags: the matmuls, and the step's other kernels (decode attention,
# a float32 step's norms, rotary turn with the cache write, silu(gate) * up).
LEVEL_SOURCES = (CSRC / "qmm_level.cpp", CSRC / "layer_level.cpp")
TORCH_SOURCE = CSRC / "qmm_torch.cpp"
HEADER = CSRC / "qmm.h"
HEADERS = (HEADER, CSRC / "lanes.h")


def _table(name: str) -> list[list[str]]:
    """The rows of qmm.h's table QMM_<name> (#define QMM_<name>(X) X(...) X(...)), each its fields as written,
    string literals unquoted: the library's lists are kept there alone, for both languages."""
    text = HEADER.read_text()
    start = text.index(f"#define QMM_{name}(X)")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    body = " ".join(lines)[len(f"#define QMM_{name}(X)"):]
    return [[field.strip().strip('"') for field in row.split(",")] for row in re.findall(r"X\(([^)]*)\)", body)]


# GGML's ids for the types the library runs.
TYPES = {name: int(ggml_id) for name, ggml_id, _, _ in _table("TYPES")}


@dataclass(frozen=True)
class Level:
    name: str    # as PAGEDCHAT_KERNEL and the status line give it
    label: str   # for people: "AVX2", "AVX-512 VNNI"
    flags: tuple[str, ...]
    symbol: str  # its name in C++: qmm::avx512_vnni


def _levels() -> tuple[Level, ...]:
    """qmm.h's QMM_LEVELS, best first, each level with its bases' flags before its own."""
    rows = {row[0]: row for row in _table("LEVELS")}

    def flags(symbol: str) -> tuple[str, ...]:
        if symbol not in rows:  # the baseline's base: none
            return ()
        _, _, _, base, own, _ = rows[symbol]
        return (*flags(base), *own.split())

    return tuple(Level(name, label, flags(symbol), symbol) for symbol, name, label, *_ in rows.values())


LEVELS = _levels()
# Every level but the baseline is x86-64's; other architectures build the portable level only.
PORTABLE = next(lv for lv in LEVELS if not lv.flags)


def levels_to_build() -> tuple[Level, ...]:
    return LEVELS if platform.machine() in ("x86_64", "AMD64") else (PORTABLE,)


@dataclass
class State:
    loaded: bool = False
    runnable: tuple[str, ...] = ()  # the library's levels this CPU runs, best first
    index: int = -1                 # the one in use, in runnable
    why_not: str = "not loaded yet"
    warned: bool = False            # whether the log has said why they do not serve


_state = State()
_lock = threading.Lock()
log = logging.getLogger(__name__)


def ready() -> bool:
    """Whether quantized weights can run from their blocks in this process now."""
    return _state.index >= 0


def runnable() -> tuple[str, ...]:
    """The levels of the loaded library that this CPU runs, best first (none before it is loaded)."""
    return _state.runnable


def level() -> Level | None:
    """The level in use, once loaded."""
    if not ready():
        return None
    return next(lv for lv in levels_to_build() if lv.name == _state.runnable[_state.index])


def forced() -> str:
    """The level PAGEDCHAT_KERNEL names, "off", or "" where it leaves the choice to the CPU (unset or auto)."""
    value = os.environ.get(ENV, "").strip().lower()
    return "" if value == "auto" else value


def best_label() -> str:
    """The best level this CPU runs, whichever is in use ("" before the library is loaded)."""
    return next((lv.label for lv in levels_to_build() if _state.runnable and lv.name == _state.runnable[0]), "")


def describe() -> str:
    """What quantized matmuls run on here, for logs and the bench's header."""
    lv = level()
    if lv is not None:
        by = f", forced by {ENV}={lv.name}" if forced() else ""
        return f"pagedchat's {lv.label} kernels (int8 dot products{by})"
    return f"torch's kernels ({_state.why_not})"


def short() -> str:
    """The path in a few characters, for the status line and F2: "AVX2", "torch"."""
    lv = level()
    return lv.label if lv is not None else "torch"


NO_COMPILER = "no C++ compiler (c++ or $CXX) on PATH"


def compiler() -> str | None:
    """The C++ compiler pagedchat's kernels are built with."""
    return shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")


def unavailable() -> str | None:
    """Why the library cannot serve here, or None where it can be built."""
    if forced() == "off":
        return f"off: {ENV}=off"
    if not sys.platform.startswith("linux"):
        return "built on Linux only"
    if compiler() is None:
        return NO_COMPILER
    return None


def library_path() -> Path:
    """Where this machine's build lives. Every level is inside and picked at run time, so the CPU's own flags
    are not part of the name: the same library serves any CPU of this architecture."""
    parts = [p.read_bytes() for p in (*LEVEL_SOURCES, TORCH_SOURCE, *HEADERS)]
    parts += [torch.__version__.encode(), platform.machine().encode(), platform.python_implementation().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return paths.cache_dir() / "kernels" / f"qmm-{key}.so"


def failure_path(target: Path) -> Path:
    """Beside a library that could not be built: why, so that every start does not try again (new sources, a
    new torch or another machine make a new name, which tries again)."""
    return target.with_suffix(".failed")


def _common() -> list[str]:
    # -ffp-contract=off: dequantize's a * u + c must round as gguf's does, not as one fused multiply-add.
    return ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", f"-I{CSRC}"]


def level_command(lv: Level, source: Path, out: Path) -> list[str]:
    return [compiler(), *_common(), *lv.flags, f"-DQMM_SYMBOL={lv.symbol}", "-c", str(source), "-o", str(out)]


def torch_command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline OpenMP, run on the libgomp torch has loaded. The levels the build
    # left out stay null there (weak symbols).
    return [compiler(), *_common(), "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), "-c", str(TORCH_SOURCE), "-o", str(out)]


def link_command(objects: list[Path], out: Path) -> list[str]:
    from torch.utils import cpp_extension

    return [compiler(), "-shared", "-fopenmp", *map(str, objects), "-o", str(out),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]


def build(target: Path, only: tuple[Level, ...] | None = None) -> list[str]:
    """Compile into target, atomically: a reader sees no library or a whole one. Levels compile side by side;
    one that this compiler cannot build is left out. Returns the names built. On failure of the rest, raises
    and leaves the compiler's message in failure_path(target). only: these levels (tests build a lower one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    wanted = only or levels_to_build()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        objs = {lv: [Path(work) / f"{lv.name}-{src.stem}.o" for src in LEVEL_SOURCES] for lv in wanted}
        jobs = {lv: [_start(level_command(lv, src, o)) for src, o in zip(LEVEL_SOURCES, objs[lv])] for lv in wanted}
        results = {lv: [(job, *job.communicate()) for job in level_jobs] for lv, level_jobs in jobs.items()}
        built = [lv for lv, runs in results.items() if all(job.returncode == 0 for job, _, _ in runs)]
        errors = {lv.name: "".join(err for job, _, err in runs if job.returncode != 0)
                  for lv, runs in results.items() if lv not in built}
        if PORTABLE in wanted and PORTABLE not in built:
            _fail(target, errors["portable"])
        if errors:
            log.info("kernel levels this compiler could not build: %s", ", ".join(errors))
        glue = Path(work) / "qmm_torch.o"
        out = Path(work) / target.name
        for command in (torch_command(glue), link_command([glue, *(o for lv in built for o in objs[lv])],
                                                                       out)):
            job = _start(command)
            _, err = job.communicate()
            if job.returncode != 0:
                _fail(target, err)
        os.replace(out, target)
    return [lv.name for lv in built]


def needs_build() -> bool:
    """Whether ensure() would compile first (for a progress line: it takes a while, once per machine)."""
    return not _state.loaded and unavailable() is None and not library_path().exists() \
        and not failure_path(library_path()).exists()


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _fail(target: Path, stderr: str) -> None:
    failure_path(target).write_text(f"compiling pagedchat's kernels failed:\n{stderr[-4000:]}")
    raise RuntimeError(f"compiling pagedchat's kernels failed (see {failure_path(target)})")


def _load_library(path: Path) -> None:
    try:
        torch.ops.load_library(str(path))
        runnable = tuple(torch.ops.pagedchat_qmm.levels())
    except (OSError, RuntimeError) as e:  # a library left by another torch, say: torch's paths serve
        _state.why_not = f"could not load {path.name}: {e}"
        return
    _state.loaded, _state.runnable = True, runnable
    _choose()


def _choose() -> None:
    """The level in use: the best this CPU runs, or the one PAGEDCHAT_KERNEL names."""
    name = forced()
    if name == "off":
        _state.index, _state.why_not = -1, f"off: {ENV}=off"
        return
    if name and name not in _state.runnable:
        known = ", ".join(lv.name for lv in levels_to_build())
        _state.index = -1
        _state.why_not = (f"{ENV}={name}: not a level this CPU runs (it runs {', '.join(_state.runnable)}; "
                          f"the levels are {known}, auto or off)")
        return
    _state.index = _state.runnable.index(name) if name else 0
    _state.why_not = ""


def use(name: str | None) -> None:
    """Switch this process to level name (None: the CPU's best), as PAGEDCHAT_KERNEL would: for tests."""
    if name is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = name
    if _state.loaded:
        _choose()


def ensure() -> str | None:
    """Load the library, building it first if this machine has none; why it is not in use, or None."""
    with _lock:  # one build at a time
        if _state.loaded:
            _choose()
            return None if ready() else _state.why_not
        why = unavailable()
        if why is None:
            why = _build_and_load(library_path())
        if why is not None and not why.startswith("off:") and not _state.warned:
            # Once per process, in the log (the engine's, in the app): the user did not ask for torch's paths.
            log.warning("pagedchat's quantized kernels are not used, torch's paths serve: %s", why)
            _state.warned = True
        _state.why_not = why or ""
        return why


def _build_and_load(path: Path) -> str | None:
    if failure_path(path).exists():
        return f"they did not compile here (see {failure_path(path)})"
    if not path.exists():
        try:
            build(path)
        except (OSError, RuntimeError) as e:
            return str(e)
    _load_library(path)
    return None if ready() else _state.why_not


# ---------------------------------------------------------------------------------------------------------------
# The ops


def matmul(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """x [M, K] @ W.T for W given as its GGUF blocks [N, bytes per row], packed (pack); the result in x's dtype."""
    return torch.ops.pagedchat_qmm.matmul(x, weight, TYPES[kind], _state.index)


def matmul_cat(x: torch.Tensor, weights: list[torch.Tensor], kinds: list[str]) -> torch.Tensor:
    """x [M, K] @ [W_0; W_1; ...].T, each W packed (pack) and of its own kind: the outputs side by side, x
    quantized once for all of them. Each output equals matmul's of its weight alone."""
    return torch.ops.pagedchat_qmm.matmul_cat(x, weights, [TYPES[k] for k in kinds], _state.index)


def activation_group(kinds: list[str], k: int) -> int:
    """The inputs per int8 scale of activation rows k wide that meet weights of these kinds: 256 where every one is
    a K type and the level sums the K types with integer sub-block scales (llama.cpp's q8_K: the AVX2 level),
    else 32."""
    return torch.ops.pagedchat_qmm.activation_group([TYPES[k_] for k_ in kinds], k, _state.index)


def decode_layer(x: torch.Tensor, weights: list[torch.Tensor], types: list[int], parts: list[int], eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, heads: int, kv_heads: int, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int) -> None:
    """One decoder layer of a float32 decode step in one call, x [T, hidden] updated in place: norm, qkv, rotary
    turn and cache write, attention, o, residual; norm, gate_up, silu(gate) * up, down, residual. The same ops
    as norm, matmul_cat, rope_write, attend and silu_mul one by one. weights: the input and post-attention norms'
    weights, then the panels of qkv's, o's, gate_up's and down's parts; types: each part's GGML type id (TYPES);
    parts: the four projections' part counts."""
    torch.ops.pagedchat_qmm.decode_layer(x, weights, types, parts, eps, cos, sin, slots, k_cache, v_cache, heads,
                                         kv_heads, block_tables, context_lens, scale, window, _state.index)


def pack(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The file's blocks [N, bytes per row] in the layout matmul reads (csrc/qmm.h): panels of 16 rows, the same
    bytes reordered; the rows after the last whole panel as they are."""
    return torch.ops.pagedchat_qmm.pack(blocks, TYPES[kind])


def unpack(weight: torch.Tensor, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of a packed weight, back in the file's layout."""
    return torch.ops.pagedchat_qmm.unpack(weight, TYPES[kind], ids)


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The blocks' rows in float32, exactly as gguf's own dequantization computes them."""
    return torch.ops.pagedchat_qmm.dequantize(blocks, TYPES[kind], _state.index)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """One decode step's attention read straight from the pages (attention.py's native path): q [B, heads, D],
    the caches [pages, block_size, kv_heads, row] (float32 or bfloat16 rows of D, or int8 rows of D codes and
    their scale: kernels/kv_pages.py), int32 block tables [B, pages] and context lengths [B]; window 0 for none.
    The result in q's dtype."""
    return torch.ops.pagedchat_qmm.attend(q, k_cache, v_cache, block_tables, context_lens, scale, window,
                                          _state.index)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of float32 rows [T, H] times weight [H], in one call (model/decoder.py's native steps)."""
    return torch.ops.pagedchat_qmm.norm(x, weight, eps, _state.index)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first of ties, a NaN above every number: torch's max indices.
    The library's where it serves (contiguous float32 rows on the CPU), else torch's."""
    if ready() and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() \
            and x.shape[0] > 0:
        return torch.ops.pagedchat_qmm.argmax_rows(x, _state.index)
    return x.max(dim=-1).indices


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for float32 [T, 2 I] holding gate and up side by side -> [T, I]."""
    return torch.ops.pagedchat_qmm.silu_mul(gate_up, _state.index)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """q and k of float32 qkv [T, (heads + 2 kv_heads) * D] turned by cos and sin [T, rotary dims] (sin's first
    half negated, as llama.rope_table makes them), k and v written into the caches at slots as their page dtype
    holds them (attend's; kv_pages.encode's bits); returns q [T, heads, D]."""
    return torch.ops.pagedchat_qmm.rope_write(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, _state.index)
