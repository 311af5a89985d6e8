"""config.toml parsing and CLI overrides."""

from pathlib import Path

import pytest

from pagedchat.config import AppConfig, ConfigError, binding_problem, load_config, parse_config


def test_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("PAGEDCHAT_DATA_DIR", str(tmp_path / "data"))
    config = load_config()
    assert config.engine.model is None and config.theme is None and config.config_file is None
    assert config.config_dir == tmp_path / "cfg" and config.data_dir == tmp_path / "data"
    assert config.user_theme_dir == tmp_path / "cfg" / "themes"


def test_file_then_cli_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text(
        'model = "some/model"\nkv_cache_memory = "2GiB"\ntheme = "pagedchat-light"\nthreads = 3\nmax_seqs = 16\n'
        'kv_cache_dtype = "int8"\nsystem_prompt = "Be terse."\n[sampling]\ntemperature = 0\nmax_tokens = 64\n'
        '[keys]\nnew_chat = "ctrl+t"\n')
    config = load_config(model="other/model", temperature=0.5, kv_cache_memory=None)
    assert config.engine.model == "other/model"          # the flag wins
    assert config.engine.kv_cache_memory == "2GiB"        # None flags change nothing
    assert config.engine.threads == 3 and config.engine.max_seqs == 16 and config.engine.kv_cache_dtype == "int8"
    assert config.theme == "pagedchat-light" and config.system_prompt == "Be terse."
    assert config.sampling.temperature == 0.5 and config.sampling.max_tokens == 64
    assert isinstance(config.sampling.temperature, float)
    assert config.keys == {"new_chat": "ctrl+t"}
    assert config.config_file == tmp_path / "config.toml"


def test_explicit_path_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("text, message", [
    ("model = ", "not valid TOML"),
    ("modle = 'x'", "unknown setting 'modle'"),
    ("block_size = '16'", "block_size must be a whole number, not '16'"),
    ("block_size = 0", "at least 1"),
    ("threads = 0", "threads must be at least 1"),
    ("threads = 'all'", "threads must be a whole number"),
    ("max_seqs = 0", "max_seqs must be at least 1"),
    ("kv_cache_dtype = 'fp4'", "kv_cache_dtype must be one of auto, float32, bfloat16, int8, not 'fp4'"),
    ("speculative = 'sometimes'", "speculative must be one of auto, ngram, off"),
    ("step_seconds = 0", "step_seconds must be a number of seconds above 0, not 0"),
    ("step_seconds = inf", "step_seconds must be a number of seconds above 0, not inf"),
    ("step_seconds = 'fast'", "step_seconds must be a number, not 'fast'"),
    ("[sampling]\ntemperature = 'hot'", "temperature must be a number, not 'hot'"),
    ("[keys]\nnew_chat = 3", r"\[keys\]"),
    ("sampling = 3", r"\[sampling\] must be a table"),
    ("[sampling]\ntemperature = nan", r"\[sampling\]: temperature must be a finite number >= 0 \(got nan\)"),
    ("[sampling]\ntemperature = 1e-40", r"temperature must be 0 \(greedy\) or at least 0.01"),
    ("[sampling]\ntop_p = 0", r"top_p must be in \(0, 1\]"),
    ("[sampling]\npresence_penalty = 2.5", r"\[sampling\]: presence_penalty must be a number in \[-2, 2\]"),
    ("[sampling]\nrepetition_penalty = 0", r"repetition_penalty must be a number > 0"),
    ("[sampling]\nmin_tokens = 1.5", r"min_tokens must be a whole number, not 1.5"),
    ("[sampling]\nlogit_bias = 1", r"unknown setting 'logit_bias' \(known: max_tokens, .*repetition_penalty\)"),
])
def test_bad_files_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(text, "config.toml")


def test_every_setting_a_chat_keeps_is_a_sampling_key(tmp_path):
    """[sampling] takes the declared chat fields, each checked by its declared rule, and new chats start there."""
    from pagedchat.engine.params import CHAT_FIELDS

    (tmp_path / "config.toml").write_text("[sampling]\nseed = 42\npresence_penalty = 0.5\nfrequency_penalty = -1\n"
                                          "repetition_penalty = 1.2\nmin_tokens = 3\ntop_k = 40\n")
    config = load_config(tmp_path / "config.toml", frequency_penalty=0.25)
    s = config.sampling
    assert (s.seed, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.top_k) == \
        (42, 0.5, 0.25, 1.2, 3, 40)
    assert isinstance(s.presence_penalty, float)
    assert {f.name for f in CHAT_FIELDS} >= {"presence_penalty", "frequency_penalty", "repetition_penalty",
                                             "min_tokens", "seed"}
    for f in CHAT_FIELDS:   # each key is known to config.toml and refused beyond the declared bounds
        if f.high is not None and f.name != "seed":
            with pytest.raises(ConfigError, match=f"{f.name} must be"):
                parse_config(f"[sampling]\n{f.name} = {f.high + 1}\n")
        if f.low is not None:
            with pytest.raises(ConfigError, match=f"{f.name} must be"):
                parse_config(f"[sampling]\n{f.name} = {f.low - 1}\n")


def test_sampling_flags_are_checked_like_requests():
    with pytest.raises(ConfigError, match="sampling: temperature must be a finite number"):
        AppConfig().with_overrides(temperature=float("inf"))


def test_with_overrides_rejects_unknown_fields():
    with pytest.raises(TypeError):
        AppConfig().with_overrides(nonsense=1)
    assert AppConfig().with_overrides(data_dir="~/x").data_dir == Path("~/x").expanduser()


def test_the_app_hands_its_thread_setting_to_the_engine(tmp_path, monkeypatch):
    """threads (config.toml or --threads) reaches the engine; unset, the engine keeps torch's one per core."""
    import pagedchat.backends.process as process_module
    from pagedchat.errors import PagedChatError
    from pagedchat.tui.app import default_backend_factory

    made = []

    def record(options, progress, log_path=None):
        made.append(options)
        raise PagedChatError("recorded")

    monkeypatch.setattr(process_module, "ProcessBackend", record)
    for threads in (None, 1):
        config = load_config(config_dir=tmp_path, threads=threads)
        with pytest.raises(PagedChatError, match="recorded"):
            default_backend_factory(config)(lambda *a: None)
    assert [options["threads"] for options in made] == [None, 1]


def test_server_and_api_key_from_file_env_and_flags(tmp_path, monkeypatch):
    """server / api_key in config.toml; PAGEDCHAT_API_KEY over the file's key, a flag over both."""
    (tmp_path / "config.toml").write_text('server = "http://gpu-box:8000/v1"\napi_key = "from-file"\n')
    monkeypatch.delenv("PAGEDCHAT_API_KEY", raising=False)
    config = load_config(config_dir=tmp_path)
    assert (config.server, config.api_key) == ("http://gpu-box:8000/v1", "from-file")
    monkeypatch.setenv("PAGEDCHAT_API_KEY", "from-env")
    assert load_config(config_dir=tmp_path).api_key == "from-env"
    assert load_config(config_dir=tmp_path, api_key="from-flag").api_key == "from-flag"
    (tmp_path / "config.toml").write_text("server = 8000\n")
    with pytest.raises(ConfigError, match="server must be a string"):
        load_config(config_dir=tmp_path)


@pytest.mark.parametrize("keys", ["ctrl+t", "f2,f9", "ctrl+shift+up", "alt+enter", "ctrl+plus", "super+c", "a",
                                  "ctrl+pagedown", "escape", "ctrl+exclamation_mark"])
def test_keys_textual_reports_are_bindings(keys):
    assert binding_problem(keys) is None


@pytest.mark.parametrize("keys, problem", [
    ("ctrl+ctrl+zz", "a modifier is given twice in 'ctrl+ctrl+zz'"),
    ("ctrl+zz", "'zz' is not a key name"),
    ("control+t", "'control' is not a modifier"),
    ("shift+ctrl+up", "Textual reports it as 'ctrl+shift+up'"),
    ("f2,", "an empty key"),
    ("ctrl+", "'' is not a key name"),
])
def test_keys_textual_never_reports_are_refused_with_the_reason(keys, problem):
    """Accepted silently before, such a binding never fired and the action lost its key."""
    assert (binding_problem(keys) or "").startswith(problem)


def test_step_seconds_is_an_engine_setting_and_a_flag(tmp_path):
    """config.toml's step_seconds reaches the engine's options, and --step-seconds overrides it."""
    from pagedchat.cli import build_parser

    (tmp_path / "config.toml").write_text("step_seconds = 2\n")
    assert load_config(tmp_path / "config.toml").engine.kwargs()["step_seconds"] == 2.0
    args = build_parser().parse_args(["ask", "--step-seconds", "0.25", "hi"])
    assert load_config(tmp_path / "config.toml", step_seconds=args.step_seconds).engine.step_seconds == 0.25


def test_speculative_is_an_engine_setting_and_a_flag(tmp_path):
    """config.toml's speculative reaches the engine's options, and --speculative overrides it."""
    from pagedchat.cli import build_parser

    (tmp_path / "config.toml").write_text('speculative = "OFF"\n')
    assert load_config(tmp_path / "config.toml").engine.kwargs()["speculative"] == "off"
    args = build_parser().parse_args(["--speculative", "ngram", "ask", "hi"])
    assert load_config(tmp_path / "config.toml", speculative=args.speculative).engine.speculative == "ngram"
