"""The user's settings: `config.toml` in the config dir, overridden by command-line flags.

Example `config.toml` (every key optional):

    model = "HuggingFaceTB/SmolLM2-360M-Instruct"   # folder, .gguf file or hub id; default: SmolLM2-135M
    kv_cache_memory = "2GiB"                         # KV cache budget; default: sized from free memory
    swap_space = "1GiB"                              # CPU tier for swapped-out / offloaded pages
    block_size = 16                                  # tokens per page
    device = "cuda"
    dtype = "float32"                                # default auto: bf16 where computed natively, else float32
    kv_cache_dtype = "int8"                          # the KV pages': auto (bfloat16), float32, bfloat16, int8
    threads = 2                                      # torch threads on the CPU; default: adapts to the load
    max_seqs = 64                                    # sequences in one batch (--max-num-seqs)
    speculative = "auto"                             # drafts from the chat's own text: auto, ngram or off
    step_seconds = 0.5                               # how long a step with a prompt in it takes, about
    system_prompt = "You are a helpful assistant."   # for new chats
    theme = "pagedchat-dark"                         # used until a theme is picked in the app
    server = "http://127.0.0.1:8000/v1"              # an OpenAI-compatible server instead of the local engine
    api_key = "..."                                  # its key (or PAGEDCHAT_API_KEY); default: none

    [sampling]                                       # defaults for new chats
    max_tokens = 1024
    temperature = 0.7
    top_p = 0.95
    top_k = 0
    seed = 42                                        # default: a fresh seed per reply
    presence_penalty = 0.0                           # [-2, 2]
    frequency_penalty = 0.0                          # [-2, 2]
    repetition_penalty = 1.0                         # > 0, 1 = off
    min_tokens = 0

    [keys]                                           # binding id = keys, see F1 in the app
    new_chat = "ctrl+t"
    toggle_inspector = "f2,ctrl+m"

This module imports nothing heavy: `pagedchat --help` reads it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pagedchat.argtypes import KV_CACHE_DTYPES
from pagedchat.engine.ngram import parse_speculative
from pagedchat.engine.scheduler import STEP_SECONDS, check_step_seconds
from pagedchat.engine.params import CHAT_FIELDS, SamplingSettings, fields_problem
from pagedchat.errors import PagedChatError
from pagedchat.paths import config_dir, data_dir

API_KEY_ENV = "PAGEDCHAT_API_KEY"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely."
DEFAULT_THEME = "pagedchat-dark"


class ConfigError(PagedChatError):
    """config.toml cannot be read or holds a value of the wrong kind."""


# The sampling settings a new chat starts with; each chat then keeps its own, of the same type.
SamplingDefaults = SamplingSettings


@dataclass(frozen=True)
class EngineOptions:
    """How to build the engine: the one record that the app (and its engine process), `ask` and `serve` hand to
    Engine(), filled from config.toml, then the flags (load_config; AppConfig.engine)."""

    model: str | None = None                 # None: the default model, pulled on first use
    kv_cache_memory: int | str | None = None
    swap_space: int | str | None = None
    block_size: int = 16
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None        # the KV pages': auto (bf16), float32, bfloat16, int8 (docs/memory.md)
    threads: int | None = None               # torch threads on the CPU; None: the engine's governor
    quantize: str | None = None              # int4 / int8: pack a safetensors model's weights group-wise
    max_seqs: int = 64                       # sequences in one batch (serve's --max-num-seqs, vLLM's name)
    speculative: str = "auto"                # n-gram drafts from the chat's own text: auto, ngram or off
    step_seconds: float = STEP_SECONDS       # a step's tokens take about this long (docs/memory.md#chunked-prefill)

    def kwargs(self) -> dict:
        """Engine's keyword arguments (plain values: they also cross to the engine process)."""
        return dataclasses.asdict(self)


ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineOptions))


@dataclass(frozen=True)
class AppConfig:
    """Everything the app needs to start. Build it with load_config(); the CLI passes its flags as overrides."""

    engine: EngineOptions = field(default_factory=EngineOptions)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    theme: str | None = None                 # None: the theme last picked in the app, else DEFAULT_THEME
    server: str | None = None                # an OpenAI-compatible server's URL: replies come from there
    api_key: str | None = None               # sent to it as a Bearer token
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    keys: dict[str, str] = field(default_factory=dict)
    config_dir: Path = field(default_factory=config_dir)
    data_dir: Path = field(default_factory=data_dir)
    config_file: Path | None = None          # the file these values came from, if any

    @property
    def user_theme_dir(self) -> Path:
        return self.config_dir / "themes"

    def with_overrides(self, **overrides) -> AppConfig:
        """A copy with the given fields replaced; None values are ignored so unset CLI flags change nothing. The
        engine's and sampling's fields are named flat, as config.toml and the flags name them."""
        fields = {f.name for f in dataclasses.fields(self)} | ENGINE_FIELDS | set(SamplingDefaults.__dataclass_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"unknown config fields: {', '.join(sorted(unknown))}")
        given = {k: v for k, v in overrides.items() if v is not None}
        engine = {k: given.pop(k) for k in list(given) if k in ENGINE_FIELDS}
        if engine:
            given["engine"] = dataclasses.replace(self.engine, **engine)
        sampling = {k: given.pop(k) for k in list(given) if k in SamplingDefaults.__dataclass_fields__}
        if sampling:
            try:
                given["sampling"] = dataclasses.replace(self.sampling, **sampling)
            except ValueError as exc:  # the same rule as every request's SamplingParams
                raise ConfigError(f"sampling: {exc}") from None
        for key in ("config_dir", "data_dir"):
            if key in given:
                given[key] = Path(given[key]).expanduser()
        return dataclasses.replace(self, **given)


# The TOML schema: key -> accepted types. Checked by hand so an error names the key and the file.
_TOP = {"model": (str,), "kv_cache_memory": (str, int), "swap_space": (str, int), "block_size": (int,),
        "device": (str,), "dtype": (str,), "kv_cache_dtype": (str,), "threads": (int,), "quantize": (str,),
        "max_seqs": (int,), "speculative": (str,), "step_seconds": (int, float),
        "system_prompt": (str,), "theme": (str,), "server": (str,), "api_key": (str,)}
_KIND_NAMES = {str: "string", int: "whole number", float: "number"}   # in words: "must be a int" read oddly
# [sampling]: the settings a chat keeps, as engine/params.py declares them (TOML has no null: an unset seed is
# left out).
_SAMPLING = {f.name: (int, float) if f.kind is float else (int,) for f in CHAT_FIELDS}


def _check(where: str, table: dict, schema: dict) -> dict:
    out = {}
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(f"{where}: unknown setting {key!r} (known: {', '.join(schema)})")
        kinds = schema[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join(_KIND_NAMES[k] for k in kinds if not (k is int and float in kinds))
            raise ConfigError(f"{where}: {key} must be a {names}, not {value!r}")
        out[key] = float(value) if float in kinds and not isinstance(value, str) else value
    return out


def parse_config(text: str, source: str = "config.toml") -> dict:
    """The overrides a config file's text asks for, validated (raises ConfigError)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML ({exc})") from None
    sampling = raw.pop("sampling", {})
    keys = raw.pop("keys", {})
    if not isinstance(sampling, dict):
        raise ConfigError(f"{source}: [sampling] must be a table")
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        raise ConfigError(f'{source}: [keys] must map binding ids to key strings, e.g. new_chat = "ctrl+t"')
    out = _check(source, raw, _TOP)
    chosen = _check(f"{source} [sampling]", sampling, _SAMPLING)
    out.update(chosen)
    problem = fields_problem(chosen)
    if problem:
        raise ConfigError(f"{source} [sampling]: {problem}")
    for key in ("block_size", "threads", "max_seqs"):
        if out.get(key, 1) < 1:
            raise ConfigError(f"{source}: {key} must be at least 1")
    if "step_seconds" in out:
        try:
            check_step_seconds(out["step_seconds"])
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if out.get("kv_cache_dtype", "auto").lower() not in KV_CACHE_DTYPES:
        raise ConfigError(f"{source}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not "
                          f"{out['kv_cache_dtype']!r}")
    if "speculative" in out:
        try:
            out["speculative"] = parse_speculative(out["speculative"])
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if keys:
        out["keys"] = dict(keys)
    return out


MODIFIERS = ("alt", "ctrl", "hyper", "meta", "shift", "super")   # as Textual names them, in its order


def binding_problem(keys: str) -> str | None:
    """Why a [keys] value ("ctrl+t", "f2,f9") holds a key Textual never reports, or None: such a binding would
    be accepted and never fire. Key names are Textual's own (its Keys and the characters' names)."""
    from textual.keys import REPLACED_KEYS, Keys, key_to_character  # the app's check: loading config stays light

    named = {k.value.rpartition("+")[2] for k in Keys}
    for key in (k.strip() for k in keys.split(",")):
        if len(key) == 1:
            continue   # a character: Textual names it itself
        *modifiers, name = key.split("+")
        unknown = [m for m in modifiers if m not in MODIFIERS]
        if not key or unknown:
            return f"{unknown[0]!r} is not a modifier ({', '.join(MODIFIERS)})" if unknown else "an empty key"
        if len(set(modifiers)) < len(modifiers):
            return f"a modifier is given twice in {key!r}"
        if modifiers != sorted(modifiers):
            return f"Textual reports it as {'+'.join(sorted(modifiers) + [name])!r}"
        if name not in named and name not in REPLACED_KEYS and key_to_character(name) is None:
            return f"{name!r} is not a key name (like a, f5, pageup, plus, enter)"
    return None


def load_config(path: str | Path | None = None, **overrides) -> AppConfig:
    """Read config.toml (path, or the one in config_dir() if it exists), then apply overrides (CLI flags).

    overrides take AppConfig field names plus the [sampling] keys (engine/params.py's CHAT_FIELDS);
    None values are ignored. A missing default file is fine; a missing explicit path or a bad file raises
    ConfigError. PAGEDCHAT_API_KEY, where set, stands between the file and the flags, so a key need not be
    written into config.toml.
    """
    base = AppConfig()
    if overrides.get("config_dir") is not None:
        base = base.with_overrides(config_dir=overrides["config_dir"])
    file = Path(path).expanduser() if path is not None else base.config_dir / "config.toml"
    from_file: dict = {}
    if file.exists() or path is not None:
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror or exc}") from None
        from_file = parse_config(text, str(file))
        base = dataclasses.replace(base, config_file=file)
    from_env = {"api_key": os.environ.get(API_KEY_ENV) or None}
    return base.with_overrides(**from_file).with_overrides(**from_env).with_overrides(**overrides)
