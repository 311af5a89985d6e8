"""The command line: help, ask, and one clear line for bad input."""

import subprocess
import sys

from pagedchat.cli import main


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
    assert capsys.readouterr().out == expected.text + "\n"


def test_bad_input_is_one_clear_line(tmp_path, tiny_llama, capsys):
    assert main(["ask", "hi", "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such model" in err[0]
    assert main(["ask", "hi", "--model", str(tiny_llama), "--kv-cache-memory", "lots"]) == 1
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_import_brings_a_json_export_back_as_a_new_chat(tmp_path, monkeypatch, capsys):
    import json

    from pagedchat.tui.store import Store

    monkeypatch.setenv("PAGEDCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path / "config"))
    export = tmp_path / "chat.json"
    export.write_text(json.dumps({"title": "Capitals", "system": "Be brief.", "settings": {"temperature": 0.2},
                                  "messages": [{"role": "user", "content": "Capital of France?"},
                                               {"role": "assistant", "content": "Paris."}]}))
    assert main(["import", str(export)]) == 0
    assert "Imported “Capitals” (2 messages)" in capsys.readouterr().out
    [chat] = Store.open(tmp_path / "data").load_chats()
    assert chat.title == "Capitals" and chat.system_prompt == "Be brief." and chat.settings.temperature == 0.2
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Capital of France?"), ("assistant", "Paris.")]
    assert chat.is_open

    export.write_text('{"messages": "hello"}')
    assert main(["import", str(export)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == 'pagedchat: error: not imported: chat.json: "messages" must be a list of {"role", "content"}'
    assert len(Store.open(tmp_path / "data").load_chats()) == 1   # nothing written for the bad file
