"""The command line: help, ask, and one clear line for bad input."""

import subprocess
import sys

from pagedchat.cli import main
from pagedchat.text import visible_controls
from tui_support import ScriptedEngine


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pagedchat.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_help_lists_commands_and_flags():
    done = run_cli("--help")
    assert done.returncode == 0
    for word in ("pull", "ask", "bench", "--model", "--kv-cache-memory", "--theme", "--threads"):
        assert word in done.stdout
    bad = run_cli("--threads", "0")
    assert bad.returncode == 2 and "'0' must be at least 1" in bad.stderr


def test_ask_matches_generate(tiny_llama, capsys):
    from pagedchat import Engine, SamplingParams

    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    [expected] = engine.generate([[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "paged blocks?"}]], SamplingParams(max_tokens=20))
    main(["ask", "paged blocks?", "--system", "Be brief.", "--model", str(tiny_llama), "--max-tokens", "20",
          "--kv-cache-memory", "4MiB"])
    assert expected.token_ids, "the tiny model should say something"
    assert capsys.readouterr().out == visible_controls(expected.text) + "\n"


def test_ask_shows_the_models_terminal_controls_instead_of_sending_them(monkeypatch, capsys):
    import pagedchat

    reply = "Done.\x1b]2;pwned\x07 \x1b]52;c;cHduZWQ=\x07 \x1b[31mred\x1b[0m \x9b2J"
    monkeypatch.setattr(pagedchat, "Engine", lambda *args, **kwargs: ScriptedEngine([reply]))
    assert main(["ask", "hi"]) == 0
    out = capsys.readouterr().out
    assert out == "Done.␛]2;pwned␇ ␛]52;c;cHduZWQ=␇ ␛[31mred␛[0m ␛[2J\n"


def test_bad_input_is_one_clear_line(tmp_path, tiny_llama, capsys):
    assert main(["ask", "hi", "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such model" in err[0]
    assert main(["ask", "hi", "--model", str(tiny_llama), "--kv-cache-memory", "lots"]) == 1
    assert "cannot read 'lots' as a size" in capsys.readouterr().err
