"""`pagedchat`: the chat app, and `pull`, `ask`, `bench`, `serve`.

Heavy imports (torch, transformers, textual) happen inside the commands, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedchat.argtypes import KV_CACHE_DTYPES, non_negative_float, positive_float, positive_int, size_bytes
from pagedchat.engine.records import FinishReason
from pagedchat.errors import PagedChatError
from pagedchat.text import visible_controls

EPILOG = """\
commands:
  pagedchat                 start the chat app (tabs, streaming, memory inspector on F2)
  pagedchat --server URL    the same app over an OpenAI-compatible server (vLLM, llama-server, ...)
  pagedchat pull            fetch and convert the default model (SmolLM2-135M-Instruct)
  pagedchat ask "question"  stream one answer to stdout (cat notes.txt | pagedchat ask "summarize this")
  pagedchat bench           measure memory and speed, optionally against transformers
  pagedchat serve           an OpenAI-compatible HTTP server over the engine
  pagedchat import F.json   bring an exported chat (ctrl+o, JSON) back as a new chat

models (--model): a Hugging Face model folder, a .gguf file, or a hub id (needs internet);
  default: SmolLM2-135M-Instruct, pulled on first use into the user cache dir.
settings: config.toml in the user config dir (see README); flags override it.
"""


ASK_MAX_TOKENS = 512
ENGINE_FLAGS = ("model", "kv_cache_memory", "swap_space", "device", "dtype", "kv_cache_dtype", "threads", "quantize",
                "max_seqs", "speculative", "step_seconds")


def _add_engine_flags(p: argparse.ArgumentParser, default=None) -> None:
    """The engine's flags (EngineOptions), and --config whose file they override. A subcommand's copies default to
    SUPPRESS, so a flag written before the subcommand (`pagedchat --model X ask`) is not reset by them."""
    p.add_argument("--config", metavar="FILE", default=default,
                   help="read this config.toml instead of the default one")
    p.add_argument("--model", "-m", default=default,
                   help="model folder, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-memory", metavar="SIZE", default=default,
                   help="KV cache budget, e.g. 512MiB or 2GB (default: sized from free memory)")
    p.add_argument("--swap-space", metavar="SIZE", default=default, help="CPU tier for offloaded and swapped pages")
    p.add_argument("--device", default=default, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=default,
                   help="auto, float32, bfloat16 or float16 (default auto: bf16 on GPUs and on CPUs with "
                   "native bf16 (AVX-512 BF16, AMX), else float32; float32 with --kv-cache-dtype float32 matches "
                   "transformers bit for bit)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=default,
                   help="the KV pages' dtype, whatever the activations' (default auto: bfloat16, half float32's "
                   "bytes; int8: about a quarter, one scale per token and KV head). See docs/memory.md")
    p.add_argument("--threads", type=positive_int, metavar="N", default=default,
                   help="torch threads on the CPU (default: one per core, fewer while other programs take cores)")
    p.add_argument("--max-num-seqs", dest="max_seqs", type=positive_int, metavar="N", default=default,
                   help="sequences in one batch at most; a request's n replies count as n, and each request keeps "
                   "a fair share (default: 64)")
    p.add_argument("--speculative", choices=("auto", "ngram", "off"), default=default,
                   help="draft tokens from the chat's own text and verify them in one step (docs/speculative.md); "
                   "auto: while few chats run (default), ngram: always, off: never")
    p.add_argument("--step-seconds", type=positive_float, metavar="SECONDS", default=default,
                   help="how long a step that prefills a prompt takes, about: a long prompt holds the other "
                   "chats' next tokens back that long (default: 0.5; more gives prompts bigger steps)")
    p.add_argument("--quantize", choices=("int4", "int8"), default=default,
                   help="pack a safetensors model's weights group-wise (weight-only; changes its numbers). GGUF "
                   "files keep their own quantization without it")


def _engine_flags(args) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def _config(args, **overrides):
    """config.toml (or --config), then the engine's flags and the given overrides: what every command starts from."""
    from pagedchat.config import load_config

    return load_config(args.config, **_engine_flags(args), **overrides)


def _sampling_type(f):
    """argparse's type for a declared sampling field: its error says the field's rule."""
    def parse(text: str):
        try:
            return f.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = f.name
    return parse


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """A flag per setting a chat keeps (engine/params.py's declaration). Unset, each stays absent: ask's own
    defaults apply (greedy, ASK_MAX_TOKENS), and the app-wide --max-tokens/--temperature are not hidden."""
    from pagedchat.engine.params import CHAT_FIELDS

    for f in CHAT_FIELDS:
        default = f" (default: {ASK_MAX_TOKENS})" if f.name == "max_tokens" else ""
        p.add_argument(f.flag, type=_sampling_type(f), default=argparse.SUPPRESS, metavar="N",
                       help=f"{f.help}: {f.rule}{default}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedchat", description="A terminal chat app on its own paged KV-cache LLM engine.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_flags(parser)
    parser.add_argument("--system", metavar="TEXT", help="system prompt for new chats")
    parser.add_argument("--theme", help="colour theme (pick others with ctrl+p in the app)")
    parser.add_argument("--max-tokens", type=int, help="reply length limit for new chats")
    parser.add_argument("--temperature", type=float, help="sampling temperature for new chats (0 = greedy)")
    parser.add_argument("--server", metavar="URL", help="run on an OpenAI-compatible server instead of in-process "
                        "(vLLM, llama-server, pagedchat serve), e.g. http://127.0.0.1:8000/v1; --model then "
                        "picks one of its models")
    parser.add_argument("--api-key", metavar="KEY", help="the server's API key (default: $PAGEDCHAT_API_KEY)")
    sub = parser.add_subparsers(dest="command", metavar="")

    pull = sub.add_parser("pull", help="fetch and convert the default model")
    pull.add_argument("--force", action="store_true", help="download and convert again")

    ask = sub.add_parser("ask", help="stream one answer to stdout")
    ask.add_argument("question", nargs="?",
                     help="the question; text piped into stdin comes before it, as the material it asks about")
    ask.add_argument("--json", action="store_true",
                     help="print the whole completion (text, token counts, timings, finish reason) as one JSON object")
    ask.add_argument("--system", metavar="TEXT", default=argparse.SUPPRESS,
                     help="system prompt (default: the app's, config.toml's system_prompt; \"\" sends none)")
    _add_sampling_flags(ask)
    ask.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                     help="ask an OpenAI-compatible server instead of the engine in-process, e.g. "
                     "http://127.0.0.1:8000/v1 (--model then picks one of its models)")
    ask.add_argument("--api-key", metavar="KEY", default=argparse.SUPPRESS,
                     help="the server's API key (default: $PAGEDCHAT_API_KEY)")
    _add_engine_flags(ask, default=argparse.SUPPRESS)

    imp = sub.add_parser("import", help="bring a JSON chat export back as a new chat")
    imp.add_argument("file", metavar="FILE.json", help='{"title", "system", "messages": [{"role", "content"}], '
                     '"settings"}, as ctrl+o writes it')

    from pagedchat import bench

    bench.add_arguments(sub.add_parser("bench", help="measure memory and speed"))

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--api-key", metavar="KEY", action="append", dest="api_keys", default=[],
                       help="require Authorization: Bearer KEY on /v1 paths; repeat it to give each client its own "
                       "key (default: $PAGEDCHAT_API_KEY, else none)")
    serve.add_argument("--max-requests-per-key", type=positive_int, metavar="N",
                       help="generation requests one client (its API key, else its address) may have open at once; "
                       "more are answered 429 (default: no limit)")
    serve.add_argument("--max-request-tokens", type=positive_int, metavar="N",
                       help="the most tokens one request may ask to generate, n x max_tokens; more are refused with "
                       "400, and a request without max_tokens gets N / n a reply (default: no limit)")
    serve.add_argument("--max-body-size", metavar="SIZE", type=size_bytes,
                       help="refuse larger request bodies with 413, e.g. 4MiB (default: 32 bytes per token of the "
                       "model's context, at least 1MiB)")
    serve.add_argument("--grammar-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                       help="refuse a response_format or tools schema with 400 when it takes longer to compile "
                       "(default: 10)")
    serve.add_argument("--limit-concurrency", type=positive_int, default=1024, metavar="N",
                       help="connections and requests at once; more are answered 503 (default: 1024)")
    serve.add_argument("--timeout-keep-alive", type=positive_float, default=5.0, metavar="SECONDS",
                       help="close a connection that sends no whole request head for this long, new or idle "
                       "(default: 5)")
    serve.add_argument("--drain-timeout", type=non_negative_float, default=3.0, metavar="SECONDS",
                       help="on SIGTERM, let open replies run this long, then end them with finish_reason "
                       "\"abort\" (default: 3)")
    _add_engine_flags(serve, default=argparse.SUPPRESS)
    return parser


class _Progress:
    """Progress on one rewritten line in a terminal; in a log, a line per stage and per tenth done."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last: tuple[str, int] | None = None

    def __call__(self, stage: str, fraction: float | None) -> None:
        if self.tty:
            suffix = f" {fraction:4.0%}" if fraction is not None else ""
            print(f"\r\033[K{stage[:70]}{suffix}", end="", file=sys.stderr, flush=True)
            return
        key = (stage.split(":")[0], int((fraction or 0) * 10))
        if key != self.last:
            self.last = key
            print(stage + (f" {fraction:.0%}" if fraction is not None else ""), file=sys.stderr, flush=True)

    def done(self, line: str = "") -> None:
        print(f"\r\033[K{line}" if self.tty else line, end="\n" if line else "", file=sys.stderr)


def cmd_pull(args) -> int:
    from pagedchat.model.pull import pull_default_model

    from pagedchat.model import qmm

    progress = _Progress()
    folder = pull_default_model(progress=progress, force=args.force)
    progress.done(f"the default model is ready in {folder}")
    # Built here so that the app's first start has them (an engine that lacks them builds them first).
    if qmm.needs_build():
        progress("compiling pagedchat's kernels for this machine (once)", None)
    qmm.ensure()
    progress.done(f"quantized matmuls: {qmm.describe()}")
    return 0


def ask_message(question: str | None, stdin) -> str:
    """The user's message for `ask`: what is piped into stdin (when it is not a terminal), then the question."""
    material = "" if stdin is None or stdin.isatty() else stdin.read().rstrip()
    parts = [part for part in (material, (question or "").strip()) if part.strip()]
    if not parts:
        raise PagedChatError('ask needs a question: pagedchat ask "...", or pipe one in: echo "..." | pagedchat ask')
    return "\n\n".join(parts)


@dataclass(frozen=True)
class AskResult:
    """`pagedchat ask --json`: one completion and its figures."""

    model: str
    text: str
    finish_reason: FinishReason | None   # written as its word
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    time_to_first_token_s: float | None
    decode_tokens_per_s: float | None
    total_s: float
    error: str | None

    @classmethod
    def of(cls, model: str, done, total_s: float) -> AskResult:
        """From a backend's Outcome."""
        return cls(model=model, text=done.text, finish_reason=done.finish_reason,
                   prompt_tokens=done.prompt_tokens, completion_tokens=done.generated_tokens,
                   cached_tokens=done.cached_tokens, prefilled_tokens=done.prefilled_tokens,
                   time_to_first_token_s=done.time_to_first_token, decode_tokens_per_s=done.decode_tokens_per_s,
                   total_s=total_s, error=done.error)

    def to_json(self) -> str:
        """One line, the text exact. JSON escapes C0 controls itself; DEL and C1 too, so no control is raw."""
        return json.dumps(asdict(self), ensure_ascii=False).translate(_JSON_CONTROL_ESCAPES)


_JSON_CONTROL_ESCAPES = {code: f"\\u{code:04x}" for code in range(0x7F, 0xA0)}


def _answer(backend, messages: list[dict], params, echo: bool):
    """Run one request; with echo, stream its text to stdout. Its Outcome (cancelled on ctrl+c)."""
    updates: queue.SimpleQueue = queue.SimpleQueue()
    reply = backend.submit(messages, params, on_update=updates.put)
    try:
        while (update := updates.get()).outcome is None:
            if echo:
                # A pipe often ends in a terminal too (less -R, cat): the model's controls are shown, never run.
                print(visible_controls(update.text), end="", flush=True)
        if echo:
            print(visible_controls(update.text), end="", flush=True)
    except KeyboardInterrupt:
        reply.cancel()
    if echo:
        print()
    return reply.result()


def cmd_ask(args) -> int:
    from pagedchat.backends.open import open_backend
    from pagedchat.engine.params import CHAT_FIELDS, SamplingParams

    # All before the model loads, so a missing question or a bad setting is said at once.
    question = ask_message(args.question, sys.stdin)
    # ask answers greedily and briefly unless told otherwise: config.toml's [sampling] is for the app's chats.
    given = {f.name: getattr(args, f.name) for f in CHAT_FIELDS if getattr(args, f.name, None) is not None}
    params = SamplingParams(**{"max_tokens": ASK_MAX_TOKENS, **given})
    config = _config(args, server=args.server, api_key=args.api_key)
    progress = _Progress()
    backend = open_backend(config, progress)
    progress.done()
    # The app's system prompt: a small model asked bare rambles where, told its role, it answers.
    system = config.system_prompt if args.system is None else args.system
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    start = time.perf_counter()
    try:
        done = _answer(backend, messages, params, echo=not args.json)
    finally:
        backend.shutdown()
    if args.json:
        print(AskResult.of(backend.info.model, done, time.perf_counter() - start).to_json())
    if done.error:
        raise PagedChatError(f"generation failed: {done.error}")
    return 0


def cmd_app(args) -> int:
    from pagedchat.tui.app import run_app

    config = _config(args, system_prompt=args.system, theme=args.theme, max_tokens=args.max_tokens,
                     temperature=args.temperature, server=args.server, api_key=args.api_key)
    run_app(config)
    return 0


def cmd_import(args) -> int:
    from pagedchat.config import load_config
    from pagedchat.tui.chat_ops import save_imported
    from pagedchat.tui.store import Store
    from pagedchat.tui.transfer import NotAChatExport, read_chat_file

    config = load_config(args.config)
    try:
        record = read_chat_file(Path(args.file))
    except NotAChatExport as exc:
        raise PagedChatError(f"not imported: {exc}") from None
    store = Store.open(config.data_dir)
    try:
        if not store.keeps_chats:   # the file cannot be used: importing into memory would keep nothing
            raise PagedChatError(f"not imported: {store.notice}")
        if store.notice:
            print(visible_controls(store.notice), file=sys.stderr)
        save_imported(store, record)
    finally:
        store.close()
    # The title and the path are the file's and the user's text: shown, never obeyed by the terminal.
    print(visible_controls(f"Imported “{record.title}” ({len(record.messages)} messages) into {store.path}; "
                           "it opens as a tab at the next start."))
    return 0


def cmd_bench(args) -> int:
    from pagedchat import bench

    return bench.run(args)


def cmd_serve(args) -> int:
    try:
        from pagedchat.serve.server import ServeOptions, serve
    except ImportError as exc:
        raise PagedChatError(f"pagedchat serve needs its extra ({exc.name} is missing): "
                             "pip install 'pagedchat[serve]'") from None
    # The engine's settings come from config.toml, then the flags; the key only from --api-key or the environment.
    return serve(ServeOptions(engine=_config(args).engine, host=args.host, port=args.port,
                              api_keys=tuple(args.api_keys), max_requests_per_key=args.max_requests_per_key,
                              max_request_tokens=args.max_request_tokens, max_body_size=args.max_body_size,
                              grammar_seconds=args.grammar_timeout,
                              limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive,
                              drain_seconds=args.drain_timeout))


COMMANDS = {"pull": cmd_pull, "ask": cmd_ask, "bench": cmd_bench, "serve": cmd_serve, "import": cmd_import,
            None: cmd_app}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (PagedChatError, ValueError) as exc:
        _Progress().done(f"pagedchat: error: {visible_controls(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
