"""`pagedchat bench`'s flags and the command itself: run, print the tables, write JSON and Markdown."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedchat.argtypes import KV_CACHE_DTYPES, positive_int
from pagedchat.bench.app_probe import DEFAULT_MAX_TOKENS as DEFAULT_APP_TOKENS
from pagedchat.bench.options import DEFAULT_CHATS, PEERS, BenchConfig, chat_counts, peer_names, prompt_lengths, \
    write_json
from pagedchat.errors import PagedChatError

DEFAULT_MAX_TOKENS = 128
DEFAULT_WINDOW_TOKENS = 4096  # --windows: a reply long enough to leave the window many pages behind
DEFAULT_FLOOD_TOKENS = 512   # --flood: each flooding reply, long enough to hold the batch for the whole round


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags on an (sub)parser."""
    parser.add_argument("--model", default=None,
                        help="model folder, .gguf file or hub id (default: the app's default model)")
    parser.add_argument("--chats", type=chat_counts, default=DEFAULT_CHATS, metavar="N,N,...",
                        help=f"concurrent chats to measure, comma-separated (default: "
                             f"{','.join(map(str, DEFAULT_CHATS))})")
    parser.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                        help="tokens generated per chat; every reply is forced to this length (default: 128; "
                             f"with --app, the reply's budget, default {DEFAULT_APP_TOKENS})")
    parser.add_argument("--system-tokens", type=positive_int, default=300, metavar="N",
                        help="length of the shared system prompt in tokens, chat template included (default: 300)")
    parser.add_argument("--seed", type=int, default=0, help="picks the user questions (default: 0)")
    parser.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                        help="rounds per level of pagedchat and each peer (transformers' padded batch, "
                             "llama.cpp), alternating; the tables show the median round, for machines shared "
                             "with other work (default: 1)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                        help="also write every figure to FILE as JSON ('-' for stdout)")
    parser.add_argument("--markdown", dest="markdown_path", default=None, metavar="FILE",
                        help="also write the tables to FILE as Markdown (for a README)")
    parser.add_argument("--against", type=peer_names, default=(), metavar="|".join(PEERS),
                        help="also run the same workload on transformers generate and/or llama.cpp "
                             "(llama-cpp-python, on the model's GGUF file), comma-separated, and report ratios")
    parser.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="KV cache budget, like 512MiB or 2GB (default: the engine's own sizing)")
    parser.add_argument("--dtype", default=None,
                        help="auto, float32, bfloat16 or float16 (default: the engine's, auto)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="the KV pages' dtype: auto (bfloat16), float32, bfloat16 or int8 (default: auto)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch threads on the CPU, and llama.cpp's (default: the engine's, one per core "
                             "and fewer while other programs take cores; llama.cpp one per core)")
    parser.add_argument("--serve", action="store_true",
                        help="instead: 8 streaming HTTP clients through `pagedchat serve` against the engine "
                             "in-process, on the same workload (the HTTP overhead in tokens/s)")
    parser.add_argument("--flood", action="store_true",
                        help="instead: short requests through `pagedchat serve`, alone and beside 4 clients each "
                             "streaming n=16 replies of --max-tokens (default 512): their latency, p50 and p99")
    parser.add_argument("--prefill", type=prompt_lengths, default=None, metavar="N,N,...",
                        help="instead: one prompt of each length alone on a cold cache, timed to its first token "
                             "(tokens/s, and over the shortest's); with --against llama.cpp, llama.cpp on the same "
                             "ids, rounds alternating. E.g. 512,2048,8192")
    parser.add_argument("--windows", action="store_true",
                        help="instead: the KV memory one long chat (--system-tokens of prompt, --max-tokens of "
                             f"reply, default {DEFAULT_WINDOW_TOKENS}) takes on a model with sliding-window layers "
                             "(Gemma 3, Mistral), with the pages its windows passed released and kept")
    parser.add_argument("--speculation", action="store_true",
                        help="instead: decode tok/s with speculative decoding (--speculative) against off, "
                             "alternating rounds on --workload's prompts, with the greedy tokens of both compared")
    parser.add_argument("--workload", choices=("chat", "copy"), default="chat",
                        help="with --speculation: the bench's support chats, or requests that copy text from "
                             "the conversation (code to edit, passages to quote) (default: chat)")
    parser.add_argument("--speculative", choices=("auto", "ngram", "off"), default=None,
                        help="the engine's speculative decoding (default: auto, as the app's)")
    parser.add_argument("--app", action="store_true",
                        help="instead: one long reply in the real app on a pseudo-terminal against the engine "
                             "alone on the same conversation (does the interface slow the engine?), --repeat "
                             "rounds alternating")
    parser.add_argument("--write-shape", nargs=2, default=None, metavar=("SHAPE", "FILE"),
                        help="instead: write a random-weight GGUF of a named model shape (llama-1b, llama-3b) "
                             "with the default model's tokenizer to FILE, in Q4_K_M by llama.cpp's quantizer "
                             "(needs llama-cpp-python), to bench with --model FILE")
    parser.add_argument("--tabs", type=positive_int, default=1, metavar="N",
                        help="with --app: N tabs generating at once (up to 4), their tok/s added up, and the "
                             "echo of keys typed meanwhile (default: 1)")


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on the mode: --app measures one long reply, the rest short forced ones."""
    if args.max_tokens is None:
        args.max_tokens = DEFAULT_APP_TOKENS if args.app else DEFAULT_WINDOW_TOKENS if args.windows else \
            DEFAULT_FLOOD_TOKENS if args.flood else DEFAULT_MAX_TOKENS
    return args


def run(args: argparse.Namespace) -> int:
    """Run the bench as the CLI asked; print the tables (and JSON). Returns the exit status."""
    args = with_defaults(args)
    if args.write_shape:
        return run_write_shape(*args.write_shape)
    if args.app:
        return run_app(args)
    if args.serve:
        from pagedchat.bench import http

        return http.run(args)
    if args.prefill:
        from pagedchat.bench import prefill

        return prefill.run(args)
    if args.flood:
        from pagedchat.bench import flood

        return flood.run(args)
    if args.windows:
        return run_windows(args)
    if args.speculation:
        return run_speculation(args)
    from rich.console import Console
    from rich.markup import escape

    from pagedchat.bench.progress import ProgressBar
    from pagedchat.bench.render import render, to_markdown
    from pagedchat.bench.report import to_json
    from pagedchat.bench.harness import run_bench

    out = Console()
    if not out.is_terminal:  # piped or redirected: wide enough that the speed table keeps one line per row
        out = Console(width=170)
    err = Console(stderr=True)
    cfg = BenchConfig(model=args.model, chats=tuple(args.chats), max_tokens=args.max_tokens,
                      system_tokens=args.system_tokens, seed=args.seed, repeat=args.repeat,
                      against=tuple(args.against), kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                      kv_cache_dtype=args.kv_cache_dtype, device=args.device, threads=args.threads,
                      speculative=args.speculative)
    try:
        with ProgressBar(err) as progress:
            report = run_bench(cfg, progress)
    except (PagedChatError, ValueError) as exc:
        err.print(f"[bold red]pagedchat bench:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    figures = json.dumps(to_json(report), indent=2)
    if args.json_path == "-":
        print(figures)
    else:
        render(report, out)
        if args.json_path:
            Path(args.json_path).write_text(figures + "\n")
            out.print(f"[dim]figures written to {args.json_path}[/]")
    if args.markdown_path:
        Path(args.markdown_path).write_text(to_markdown(report))
    return 0


def run_windows(args: argparse.Namespace) -> int:
    """`--windows`: one long chat's peak KV memory with the window layers' passed pages released and kept."""
    from pagedchat.bench.windows import render_windows, run_windows as measure

    cfg = BenchConfig(model=args.model, max_tokens=args.max_tokens, system_tokens=args.system_tokens,
                      kv_cache_memory=args.kv_cache_memory, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                      device=args.device, threads=args.threads)
    try:
        report = measure(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (PagedChatError, ValueError) as exc:
        print(f"pagedchat bench: {exc}", file=sys.stderr)
        return 2
    print(render_windows(report))
    from dataclasses import asdict

    write_json(args.json_path, asdict(report))
    return 0


def run_speculation(args: argparse.Namespace) -> int:
    """`--speculation`: decode tok/s with speculation against off, per level of --chats, alternating rounds."""
    from pagedchat.bench.speculative import render_speculation, run_speculation as measure

    cfg = BenchConfig(model=args.model, chats=tuple(args.chats), max_tokens=args.max_tokens,
                      system_tokens=args.system_tokens, seed=args.seed, repeat=max(2, args.repeat),
                      kv_cache_memory=args.kv_cache_memory, dtype=args.dtype, device=args.device,
                      threads=args.threads)
    try:
        report = measure(cfg, args.workload, args.speculative or "auto",
                         progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (PagedChatError, ValueError) as exc:
        print(f"pagedchat bench: {exc}", file=sys.stderr)
        return 2
    print(render_speculation(report))
    return 0


def run_app(args: argparse.Namespace) -> int:
    """`--app`: the reply line's tok/s in the real app against the engine alone, per round and their ratio."""
    from pagedchat.bench.app_probe import percentile, run_app_probe

    # The app and the engine alone get the same settings: the engine's names, the app's flags.
    options = {name: getattr(args, name) for name in ("kv_cache_memory", "dtype", "kv_cache_dtype", "device", "threads")
               if getattr(args, name)}
    try:
        report = run_app_probe(args.model, args.repeat, args.max_tokens, options, tabs=args.tabs,
                               progress=lambda line: print(line, flush=True))
    except PagedChatError as exc:
        print(f"pagedchat bench: {exc}", file=sys.stderr)
        return 2
    print(f"{report.model}: the app's reply line at {report.ratio:.2f}x the engine alone (median of "
          f"{len(report.rounds)} rounds)")
    if echoes := report.echoes_s:
        print(f"keys typed while {args.tabs} tabs streamed: echoed in {percentile(echoes, 0.5) * 1000:.0f} ms "
              f"median, {percentile(echoes, 0.95) * 1000:.0f} ms p95 ({len(echoes)} keys)")
    return 0


def run_write_shape(name: str, path: str) -> int:
    """`--write-shape SHAPE FILE`: a model-shaped file of random weights (bench/shapes.py)."""
    from pagedchat.bench.shapes import write_shape

    try:
        out = write_shape(name, Path(path), progress=lambda line: print(line, file=sys.stderr, flush=True))
    except PagedChatError as exc:
        print(f"pagedchat bench: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}: bench it with `pagedchat bench --model {out}`")
    return 0
