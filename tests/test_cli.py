"""The command line: help, ask, and one clear line for bad input."""

import io
import json
import re
import subprocess
import sys

import pytest

from pagedchat.cli import main
from pagedchat.text import visible_controls
from tiny_models import make_tiny_model
from tui_support import ScriptedEngine


def run_cli(*args, env=None, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "pagedchat.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, input=stdin)


@pytest.fixture(autouse=True)
def _stdin(monkeypatch):
    """`ask` reads stdin when it is not a terminal; in-process calls get an empty one, as with `< /dev/null`."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def scripted(monkeypatch, replies) -> ScriptedEngine:
    """`ask` on the scripted stand-in engine (the Engine the local backend builds)."""
    from pagedchat.engine import engine as engine_module

    engine = ScriptedEngine(replies)
    monkeypatch.setattr(engine_module, "Engine", lambda *args, **kwargs: engine)
    return engine


def user_message(engine: ScriptedEngine) -> str:
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    return prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


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


def test_ask_sends_the_apps_system_prompt_unless_told_otherwise(monkeypatch, tmp_path):
    from pagedchat.config import DEFAULT_SYSTEM_PROMPT

    def system_turn(*flags):
        engine = scripted(monkeypatch, ["Paris."])
        assert main(["ask", "What is the capital of France?", *flags]) == 0
        prompt = engine.tokenizer.decode(engine.prompts[-1])
        return prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0] if "system\n" in prompt else None

    assert system_turn() == DEFAULT_SYSTEM_PROMPT
    assert system_turn("--system", "Answer in French.") == "Answer in French."
    config = tmp_path / "config.toml"
    config.write_text('system_prompt = "Be terse."\n')
    assert system_turn("--config", str(config)) == "Be terse."
    assert system_turn("--system", "") != DEFAULT_SYSTEM_PROMPT   # none sent: the template's own, if it has one


def test_ask_shows_the_models_terminal_controls_instead_of_sending_them(monkeypatch, capsys):
    reply = "Done.\x1b]2;pwned\x07 \x1b]52;c;cHduZWQ=\x07 \x1b[31mred\x1b[0m \x9b2J"
    scripted(monkeypatch, [reply])
    assert main(["ask", "hi"]) == 0
    out = capsys.readouterr().out
    assert out == "Done.␛]2;pwned␇ ␛]52;c;cHduZWQ=␇ ␛[31mred␛[0m ␛[2J\n"


def test_bad_input_is_one_clear_line(tmp_path, tiny_llama, capsys):
    assert main(["ask", "hi", "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such model" in err[0]
    assert main(["ask", "hi", "--model", str(tiny_llama), "--kv-cache-memory", "lots"]) == 1
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_ask_reads_piped_material_before_the_question(monkeypatch, capsys):
    engine = scripted(monkeypatch, ["A summary."])
    monkeypatch.setattr(sys, "stdin", io.StringIO("line one\n  indented line two\n\n"))
    assert main(["ask", "summarize this"]) == 0
    assert user_message(engine) == "line one\n  indented line two\n\nsummarize this"
    assert capsys.readouterr().out == "A summary.\n"


def test_ask_takes_the_question_from_stdin_alone(monkeypatch, capsys):
    engine = scripted(monkeypatch, ["Paris."])
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    assert main(["ask"]) == 0
    assert user_message(engine) == "What is the capital of France?"


def test_ask_on_a_terminal_does_not_read_stdin(monkeypatch, capsys):
    engine = scripted(monkeypatch, ["Hi.", "never"])
    monkeypatch.setattr(sys, "stdin", _Terminal("typed ahead, not material"))
    assert main(["ask", "hello"]) == 0
    assert user_message(engine) == "hello"
    assert main(["ask"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['pagedchat: error: ask needs a question: pagedchat ask "...", or pipe one in: '
                   'echo "..." | pagedchat ask']
    assert len(engine.prompts) == 1  # refused before any model was asked


def test_ask_json_is_one_object_with_the_exact_text(monkeypatch, capsys):
    reply = "Je répondrai.\x1b]2;pwned\x07\x9b2J\x7f"
    scripted(monkeypatch, [reply])
    assert main(["ask", "hi", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and not re.search(r"[\x00-\x1f\x7f-\x9f]", out.rstrip("\n"))
    result = json.loads(out)
    assert result["text"] == reply and "répondrai" in out       # exact, and readable where it can be
    assert result["finish_reason"] == "stop" and result["error"] is None and result["model"] == "scripted-model"
    assert result["completion_tokens"] == 3 and result["prompt_tokens"] > 0 and result["cached_tokens"] == 0
    assert result["time_to_first_token_s"] == 0.02 and result["total_s"] > 0


def test_ask_takes_every_chat_sampling_setting_as_a_flag(monkeypatch, capsys):
    """--presence-penalty and the rest come from the declared fields; unset ones keep ask's greedy defaults."""
    from pagedchat.engine.params import CHAT_FIELDS, SamplingParams

    engine = scripted(monkeypatch, ["ok"])
    assert main(["ask", "hi", "--presence-penalty", "0.5", "--frequency-penalty", "-1", "--repetition-penalty",
                 "1.2", "--min-tokens", "2", "--top-k", "5", "--seed", "7"]) == 0
    assert engine.params[-1] == SamplingParams(max_tokens=512, presence_penalty=0.5, frequency_penalty=-1.0,
                                               repetition_penalty=1.2, min_tokens=2, top_k=5, seed=7)
    help_text = run_cli("ask", "--help").stdout
    assert all(f.flag in help_text for f in CHAT_FIELDS)

    with pytest.raises(SystemExit) as exit:
        main(["ask", "hi", "--presence-penalty", "2.5"])
    assert exit.value.code == 2
    assert "argument --presence-penalty: presence_penalty must be a number in [-2, 2] (got 2.5)" in \
        capsys.readouterr().err
    assert len(engine.params) == 1   # refused before any model was asked


def test_piped_ask_json_on_a_real_engine_matches_generate(tiny_llama):
    from pagedchat import Engine, SamplingParams

    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB")
    from pagedchat.config import DEFAULT_SYSTEM_PROMPT

    [expected] = engine.generate([[{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                   {"role": "user", "content": "notes about pages\n\nsummarize this"}]],
                                 SamplingParams(max_tokens=12))
    engine.shutdown()
    done = run_cli("ask", "summarize this", "--json", "--model", str(tiny_llama), "--max-tokens", "12",
                   "--kv-cache-memory", "4MiB", stdin="notes about pages\n")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["text"] == expected.text and result["completion_tokens"] == len(expected.token_ids) == 12
    assert result["prompt_tokens"] == len(expected.prompt_token_ids) and result["finish_reason"] == "length"
    assert result["decode_tokens_per_s"] > 0


def test_ask_over_a_server_answers_as_the_engine_in_process(tmp_path):
    from remote_support import running_server

    model = make_tiny_model(tmp_path / "model", seed=2)  # a seed whose greedy reply is visible text
    flags = ("--json", "--max-tokens", "12")
    local = run_cli("ask", "what is a page?", *flags, "--model", str(model), "--kv-cache-memory", "4MiB",
                    "--threads", "1")
    assert local.returncode == 0, local.stderr
    with running_server(model, tmp_path) as server:
        remote = run_cli("ask", "what is a page?", *flags, "--server", server.url)
    assert remote.returncode == 0, remote.stderr
    # The stream's iterators are closed before the client's loop stops (it printed this at exit, now and then).
    assert "Task was destroyed" not in remote.stderr
    here, there = json.loads(local.stdout), json.loads(remote.stdout)
    assert there["text"] == here["text"] and there["text"]
    assert (there["prompt_tokens"], there["completion_tokens"]) == (here["prompt_tokens"], here["completion_tokens"])


def test_ask_names_a_server_it_cannot_reach(capsys):
    from remote_support import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["ask", "hi", "--server", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"pagedchat: error: Cannot reach the server at {url}"), err


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


def test_import_of_a_title_already_saved_gets_a_distinct_one(tmp_path, monkeypatch, capsys):
    """Two chats of one title could not be told apart in the tabs or the delete prompt."""
    from pagedchat.tui.store import Store

    monkeypatch.setenv("PAGEDCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path / "config"))
    export = tmp_path / "chat.json"
    export.write_text(json.dumps({"title": "Capitals", "messages": [{"role": "user", "content": "Capital?"}]}))
    for _ in range(3):
        assert main(["import", str(export)]) == 0
    out = capsys.readouterr().out
    assert "Imported “Capitals (imported)”" in out and "Imported “Capitals (imported 2)”" in out
    chats = Store.open(tmp_path / "data").load_chats()
    assert [c.title for c in chats] == ["Capitals", "Capitals (imported)", "Capitals (imported 2)"]
    assert [c.position for c in chats] == [0, 1, 2]


def test_import_prints_a_crafted_title_as_text(tmp_path, monkeypatch, capsys):
    """The success line was the one place a title reached the terminal raw: OSC 2 set the window title, CSI 2J
    cleared the screen, U+202E reversed what followed."""
    monkeypatch.setenv("PAGEDCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path / "config"))
    export = tmp_path / "chat.json"
    title = "x\x1b]2;pwned\x07\x1b[2J\u202eevil"
    export.write_text(json.dumps({"title": title, "messages": [{"role": "user", "content": "hi"}]}))
    assert main(["import", str(export)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert f"Imported “{visible_controls(title)}” (1 messages)" in out


def test_import_takes_a_plain_openai_messages_array(tmp_path, monkeypatch, capsys):
    from pagedchat.tui.store import Store

    monkeypatch.setenv("PAGEDCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path / "config"))
    export = tmp_path / "messages.json"
    export.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Capital of France?"},
                                  {"role": "assistant", "content": "Paris."}]))
    assert main(["import", str(export)]) == 0
    [chat] = Store.open(tmp_path / "data").load_chats()
    assert chat.system_prompt == "Be brief." and chat.title == "Capital of France?"
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Capital of France?"), ("assistant", "Paris.")]


def test_import_into_an_unusable_store_is_an_error_not_a_success(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path / "config"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chats.db").symlink_to("/dev/null")
    export = tmp_path / "chat.json"
    export.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    assert main(["import", str(export)]) == 1
    captured = capsys.readouterr()
    assert "Imported" not in captured.out and "not imported: Saved chats in" in captured.err
    assert "is a device (/dev/null)" in captured.err


def test_every_subcommand_has_its_handler():
    """A subcommand the parser accepts but COMMANDS lacks fails with a KeyError (`serve` did after a merge)."""
    import argparse

    from pagedchat.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(COMMANDS) == set(sub.choices) | {None}


def engine_options(monkeypatch, replies=("Yes.",)) -> list[dict]:
    """The keyword arguments each Engine the command builds is given (a scripted engine answers)."""
    from pagedchat.engine import engine as engine_module

    seen: list[dict] = []

    def build(*args, **kwargs):
        seen.append(kwargs)
        return ScriptedEngine(list(replies))

    monkeypatch.setattr(engine_module, "Engine", build)
    return seen


@pytest.mark.parametrize("argv", [["--model", "m1", "--dtype", "float32", "ask", "q"],
                                  ["ask", "q", "--model", "m1", "--dtype", "float32"]])
def test_engine_flags_count_before_and_after_the_subcommand(monkeypatch, tmp_path, argv):
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path))
    seen = engine_options(monkeypatch)
    assert main(argv) == 0
    assert seen[-1]["model"] == "m1" and seen[-1]["dtype"] == "float32"


def test_ask_reads_config_toml_and_its_flags_win(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text('model = "from-file"\nthreads = 2\nkv_cache_memory = "8MiB"\n')
    seen = engine_options(monkeypatch)
    assert main(["ask", "q", "--kv-cache-memory", "4MiB", "--kv-cache-dtype", "bfloat16"]) == 0
    assert (seen[-1]["model"], seen[-1]["threads"], seen[-1]["kv_cache_memory"]) == ("from-file", 2, "4MiB")
    assert seen[-1]["kv_cache_dtype"] == "bfloat16"
    assert main(["--config", str(tmp_path / "missing.toml"), "ask", "q"]) == 1
    assert "missing.toml" in capsys.readouterr().err


def test_serve_builds_its_engine_from_config_toml_and_its_flags(monkeypatch, tmp_path):
    from pagedchat.serve import server

    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text('model = "from-file"\ndtype = "float32"\n')
    served = []
    monkeypatch.setattr(server, "serve", lambda options: served.append(options) or 0)
    assert main(["serve", "--quantize", "int4", "--kv-cache-dtype", "int8", "--port", "8001"]) == 0
    [options] = served
    assert options.port == 8001 and options.model_name == "from-file"
    assert (options.engine.model, options.engine.dtype, options.engine.quantize) == ("from-file", "float32", "int4")
    assert options.engine.kv_cache_dtype == "int8"
