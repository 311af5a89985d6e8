"""`pagedchat bench`: what the paged KV cache buys, measured on this machine.

One run answers, side by side:
  1. what one token of context costs (from the model's shape, and read back from the allocated pool);
  2. how many chats fit in the KV budget when paged, against reserving the model's full context per chat,
     and the slots each scheme wastes on the real run;
  3. how many pages N chats with one S-token system prompt use with prefix sharing, against without;
  4. speed at each concurrency (end-to-end and decode tokens/s, time to first token, inter-token latency),
     and a cold against a warm (system prompt already cached) first token;
  5. with --against transformers, the same workload on transformers `generate`, one chat at a time and as a
     left-padded batch, in the same process, as ratios.

The workload is fixed: a realistic system prompt cut or padded to exactly --system-tokens tokens, distinct user
questions chosen by --seed, greedy decoding, and every reply forced to --max-tokens tokens (ignore_eos on the
engine, min_new_tokens on transformers). `add_arguments` and `run` are the CLI's entry points.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagedchat.cli import positive_int
from pagedchat.errors import PagedChatError

DEFAULT_CHATS = "1,2,4,8,16"
WARM_REPEATS = 3

SYSTEM_POLICY = """\
You are Harbor, the support assistant of Northwind Outfitters, an online shop for outdoor clothing and camping \
gear. You answer customers in the chat window of the shop's website and mobile app. Follow this policy.

Tone and format. Be warm, direct and brief: two to five sentences for simple questions, a short numbered list \
for step-by-step instructions. Use the customer's name when they give it. Never use sarcasm, and do not \
apologise more than once per conversation. Write prices in the customer's currency with two decimals, dates as \
"12 March 2025", and sizes exactly as printed on the size chart.

Orders and delivery. Standard delivery takes three to five working days within the country and costs 4.95, \
free above 60.00. Express delivery arrives the next working day when ordered before 14:00 and costs 9.95. You \
may look up an order only after the customer gives both the order number, which starts with NW followed by \
eight digits, and the email address used at checkout. If a parcel is more than five working days late, offer \
to open a carrier investigation; if it is more than ten days late, offer a replacement or a full refund.

Returns and refunds. Unworn items with their tags may be returned within 30 days of delivery for a full refund; \
sale items within 14 days. Footwear must come back in its original box. Refunds go to the original payment \
method within five working days of the return arriving at our warehouse. Opened sleeping bags, water filters \
and underwear cannot be returned for hygiene reasons unless they are faulty.

Warranty and safety. Tents, backpacks and jackets carry a two-year warranty against manufacturing defects. \
Never advise on using stoves, heaters or lanterns inside a tent or any closed space: tell the customer that \
this risks carbon monoxide poisoning and point to the product manual. For questions about avalanche gear, \
climbing protection or first aid, give general information only and recommend a certified instructor.

Privacy and limits. Never ask for full card numbers, passwords or security codes, and never repeat personal \
data the customer has not typed in this conversation. Do not promise discounts, price matches or delivery \
dates that this policy does not allow. If a request falls outside this policy, or the customer asks for a \
person, offer a hand-over to the human team, available Monday to Saturday from 08:00 to 20:00, and summarise \
the case in one sentence so that nobody has to ask the customer twice.
"""

QUESTIONS = [
    "My order NW20481377 was due on Tuesday and still hasn't arrived. What can you do?",
    "Can I return a pair of hiking boots I wore once on a short walk around the block?",
    "What is the difference between the 2-person and the 3-person Trailhead tent besides the size?",
    "Is it safe to run a small gas heater inside my tent if I keep the door half open?",
    "How long does a refund take once you receive my return, and where does the money go?",
    "I bought a sleeping bag in the sale ten days ago and it's too short. Can I swap it for a longer one?",
    "Which jacket would you recommend for autumn hiking in the rain when it's around eight degrees?",
    "Do you ship express on Saturdays, and what time do I need to order by?",
    "The zip on my backpack broke after eighteen months of normal use. Is that covered?",
    "What should I pack for a first overnight camping trip in spring with two children?",
    "Can you give me a discount if I buy a tent, two sleeping bags and a stove together?",
    "How do I know which size of trail running shoe to order if I'm usually between two sizes?",
    "I typed the wrong delivery address for order NW31975520. Can it still be changed?",
    "Is the Alpine 45 backpack carry-on size for most European airlines?",
    "My water filter arrived with a cracked housing. I opened it before I noticed. Can I return it?",
    "What is your warranty on tent poles, and what do I do if one snaps in strong wind?",
    "I'd like to speak to a person about a complaint. When is your team available?",
    "How should I wash and re-proof a waterproof shell jacket so it keeps beading water?",
    "Can you explain how to pitch a tunnel tent alone when it's windy?",
    "Do you price-match a cheaper offer I found on another website for the same stove?",
    "What's the warmest sleeping bag you sell that still packs smaller than a loaf of bread?",
    "My refund was approved a week ago but I still don't see it on my card. What's going on?",
    "Which headlamp would you suggest for night hikes, and how long do the batteries last?",
    "I'm planning a winter hut trip. What avalanche safety gear do I need to bring?",
]


WARM_QUESTION = "Which of your tents is the lightest one for a solo bikepacking trip, and what does it weigh?"


class BenchError(PagedChatError):
    """The bench cannot run as asked: one line, non-zero exit."""


# ---- the CLI ---------------------------------------------------------------------------------------------------
def _chat_counts(value: str) -> list[int]:
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {value!r}: give chat counts like 1,2,4,8") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: chat counts must be positive integers, like 1,2,4,8")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags on an (sub)parser."""
    parser.add_argument("--model", default=None,
                        help="model folder, .gguf file or hub id (default: the app's default model)")
    parser.add_argument("--chats", type=_chat_counts, default=_chat_counts(DEFAULT_CHATS), metavar="N,N,...",
                        help=f"concurrent chats to measure, comma-separated (default: {DEFAULT_CHATS})")
    parser.add_argument("--max-tokens", type=positive_int, default=128, metavar="N",
                        help="tokens generated per chat; every reply is forced to this length (default: 128)")
    parser.add_argument("--system-tokens", type=positive_int, default=300, metavar="N",
                        help="length of the shared system prompt in tokens, chat template included (default: 300)")
    parser.add_argument("--seed", type=int, default=0, help="picks the user questions (default: 0)")
    parser.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                        help="rounds of pagedchat and of transformers' padded batch per level, alternating; the "
                             "tables show the median round, for machines shared with other work (default: 1)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                        help="also write every figure to FILE as JSON ('-' for stdout)")
    parser.add_argument("--markdown", dest="markdown_path", default=None, metavar="FILE",
                        help="also write the tables to FILE as Markdown (for a README)")
    parser.add_argument("--against", choices=["transformers"], default=None,
                        help="also run the same workload on transformers generate and report ratios")
    parser.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="KV cache budget, like 512MiB or 2GB (default: the engine's own sizing)")
    parser.add_argument("--dtype", default=None,
                        help="auto, float32, bfloat16 or float16 (default: the engine's, auto)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--serve", action="store_true",
                        help="instead: 8 streaming HTTP clients through `pagedchat serve` against the engine "
                             "in-process, on the same workload (the HTTP overhead in tokens/s)")


def run(args: argparse.Namespace) -> int:
    """Run the bench as the CLI asked; print the tables (and JSON). Returns the exit status."""
    if getattr(args, "serve", False):
        from pagedchat.serve import bench as serve_bench

        return serve_bench.run(args)
    from rich.console import Console

    out = Console()
    if not out.is_terminal:  # piped or redirected: wide enough that the speed table keeps one line per row
        out = Console(width=150)
    err = Console(stderr=True)
    cfg = BenchConfig(model=args.model, chats=list(args.chats), max_tokens=args.max_tokens,
                      system_tokens=args.system_tokens, seed=args.seed, repeat=args.repeat, against=args.against,
                      kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                      device=getattr(args, "device", None))
    try:
        with _progress_bar(err) as progress:
            report = run_bench(cfg, progress)
    except (PagedChatError, ValueError) as exc:
        err.print(f"[bold red]pagedchat bench:[/] {exc}", highlight=False, soft_wrap=True)
        return 2
    if args.json_path == "-":
        print(json.dumps(report, indent=2))
    else:
        render(report, out)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
            out.print(f"[dim]figures written to {args.json_path}[/]")
    if getattr(args, "markdown_path", None):
        Path(args.markdown_path).write_text(to_markdown(report))
    return 0


# ---- the workload ----------------------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    model: str | None = None
    chats: list[int] = field(default_factory=lambda: _chat_counts(DEFAULT_CHATS))
    max_tokens: int = 128
    system_tokens: int = 300
    seed: int = 0
    repeat: int = 1
    against: str | None = None
    kv_cache_memory: str | int | None = None
    dtype: str | None = None
    device: str | None = None


@dataclass
class Workload:
    system_ids: list[int]          # the shared prefix, exactly system_tokens long
    questions: list[str]           # one per chat, for the largest concurrency
    prompts: list[list[int]]       # system_ids + that chat's user turn
    head: list[int]                # template tokens before the system text (part of system_ids)
    tail: list[int]                # template tokens after it (part of system_ids)
    post: list[int]                # template tokens after the user text
    encode: Callable[[str], list[int]]

    def cold_prefix(self, k: int) -> list[int]:
        """A system prompt of the same length whose first page differs from the real one's and from every other
        cold_prefix(j)'s, so it shares no page with them: a cold start for the prefix cache."""
        body = self.system_ids[len(self.head):len(self.system_ids) - len(self.tail)]
        marked = (self.encode(f"[{k}] ") + body)[:len(body)]
        return self.head + marked + self.tail

    def user_turn(self, question: str) -> list[int]:
        return self.encode(question) + self.post


_SYS, _USR = "\x00SYSTEM\x00", "\x00USER\x00"


def _template_parts(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """Token ids around the system text, between it and the user text, and after the user text."""
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    if getattr(tokenizer, "chat_template", None):
        try:
            messages = [{"role": "system", "content": _SYS}, {"role": "user", "content": _USR}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception:
            text = ""
        if text.count(_SYS) == 1 and text.count(_USR) == 1 and text.index(_SYS) < text.index(_USR):
            pre, rest = text.split(_SYS)
            mid, post = rest.split(_USR)
            return enc(pre), enc(mid), enc(post)
    bos = tokenizer.encode("", add_special_tokens=True)
    return list(bos), enc("\n\n"), enc("\n")


def build_workload(tokenizer, system_tokens: int, num_chats: int, seed: int) -> Workload:
    head, mid, post = _template_parts(tokenizer)
    body_len = system_tokens - len(head) - len(mid)
    if body_len < 1:
        raise BenchError(f"--system-tokens {system_tokens} is too short: this model's chat template alone takes "
                         f"{len(head) + len(mid)} tokens around the system prompt")
    policy = tokenizer.encode(SYSTEM_POLICY, add_special_tokens=False)
    body = list(policy)
    while len(body) < body_len:  # pad by repeating the policy, paragraph-separated
        body += tokenizer.encode("\n\n", add_special_tokens=False) + policy
    system_ids = head + body[:body_len] + mid
    rng = random.Random(seed)
    order = rng.sample(QUESTIONS, len(QUESTIONS))
    questions = [order[i % len(order)] + (f" (Question {i // len(order) + 1}.)" if i >= len(order) else "")
                 for i in range(num_chats)]
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = [system_ids + encode(q) + post for q in questions]
    return Workload(system_ids, questions, prompts, head, mid, post, encode)


# ---- statistics ------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(values: list[float]) -> float | None:
    return percentile(values, 50)


def timing_stats(start: float, arrivals: list[list[float]], starts: list[float] | None = None) -> dict:
    """Speed figures from per-chat token arrival times. TTFT counts from `start` (all chats submitted together)."""
    total = sum(len(a) for a in arrivals)
    end = max(a[-1] for a in arrivals if a)
    firsts = [a[0] for a in arrivals if a]
    ttft = [f - start for f in firsts]
    itl = [b - a for arr in arrivals for a, b in zip(arr, arr[1:])]
    # Decode: from the moment every chat has its first token to the last token, the tokens that arrived in it.
    all_in = max(firsts)
    decoded = sum(1 for arr in arrivals for t in arr if t > all_in)
    span = end - all_in
    return {
        "tokens": total,
        "wall_s": end - start,
        "end_to_end_tokens_per_s": total / (end - start),
        "decode_tokens_per_s": decoded / span if span > 0 and decoded else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_s": percentile(itl, 50),
        "itl_p95_s": percentile(itl, 95),
    }


# ---- progress --------------------------------------------------------------------------------------------------
class _progress_bar:
    """A rich progress bar on stderr; `advance(n)` and `describe(text)` are safe from the engine thread."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:<42}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("tokens"), TimeElapsedColumn(), console=console, transient=True)
        self.task = None

    def __enter__(self):
        self.progress.start()
        self.task = self.progress.add_task("starting", total=None)
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def set_total(self, total: int) -> None:
        self.progress.update(self.task, total=total)

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)


class _NoProgress:
    def set_total(self, total: int) -> None: ...
    def describe(self, text: str) -> None: ...
    def advance(self, n: int = 1) -> None: ...


# ---- the engine side -------------------------------------------------------------------------------------------
def _new_engine(cfg: BenchConfig, max_chats: int, describe: Callable[[str], None]):
    from pagedchat.engine.engine import Engine

    describe("loading the engine")
    return Engine(cfg.model, kv_cache_memory=cfg.kv_cache_memory, dtype=cfg.dtype, device=cfg.device,
                  swap_space=0, max_seqs=max(64, max_chats))


def token_cost(engine) -> dict:
    """KV bytes per token: from the model's shape, and read back from the pool the engine allocated."""
    cfg = engine.config
    kv = engine.runner.kv_cache
    elem = kv.element_size()
    slots = engine.blocks.num_pages * engine.block_size
    return {
        "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "dtype": str(kv.dtype).removeprefix("torch."), "dtype_bytes": elem,
        "bytes_per_token_model": cfg.kv_bytes_per_token(elem),
        "bytes_per_token_pool": kv.numel() * elem / slots,
        "pool_bytes": kv.numel() * elem,
        "num_pages": engine.blocks.num_pages, "block_size": engine.block_size,
        "page_bytes": engine.cache_plan.page_bytes, "token_slots": slots,
        "max_context": cfg.max_position_embeddings,
    }


def capacity(cost: dict, system_tokens: int, chat_tokens: int) -> dict:
    """Chats of chat_tokens tokens (system prompt included) that fit in the pool, by scheme."""
    bs, pages, ctx = cost["block_size"], cost["num_pages"], cost["max_context"]
    per_chat = -(-chat_tokens // bs)
    shared = system_tokens // bs  # full pages of pure system prompt: the ones chats can share
    return {
        "chat_tokens": chat_tokens,
        "paged_shared": {"slots_per_chat": (per_chat - shared) * bs, "shared_slots": shared * bs,
                         "chats": max(0, (pages - shared) // (per_chat - shared)) if per_chat > shared else None,
                         "waste_slots_per_chat": per_chat * bs - chat_tokens},
        "paged": {"slots_per_chat": per_chat * bs, "chats": pages // per_chat,
                  "waste_slots_per_chat": per_chat * bs - chat_tokens},
        "contiguous": {"slots_per_chat": ctx, "chats": cost["token_slots"] // ctx,
                       "waste_slots_per_chat": ctx - chat_tokens},
    }


def pages_needed(prompts: list[list[int]], max_tokens: int, system_tokens: int, block_size: int) -> int:
    """Pages the workload holds at most with its system prompt shared."""
    shared = system_tokens // block_size
    return shared + sum(-(-(len(p) + max_tokens) // block_size) - shared for p in prompts)


def peak_accounting(snap, max_context: int) -> dict:
    """Allocated against used slots in a MemorySnapshot, paged (as it is) and contiguous (as it would be)."""
    bs = snap.block_size
    fill: dict[int, int] = {}  # page -> tokens it holds; a shared page holds the same tokens for every owner
    per_seq = []
    for seq in snap.seqs.values():
        held = seq.num_computed
        per_seq.append({"request_id": seq.request_id, "tokens": held, "pages": len(seq.pages)})
        for j, page in enumerate(seq.pages):
            fill[page] = max(fill.get(page, 0), min(bs, max(0, held - j * bs)))
    tokens = sum(s["tokens"] for s in per_seq)
    unique_tokens = sum(fill.values())
    used = snap.used_blocks
    unshared = sum(-(-s["tokens"] // bs) for s in per_seq)
    n = len(per_seq)
    return {
        "chats_live": n,
        "tokens_held": tokens,                       # K/V stored, counted per chat
        "unique_tokens_held": unique_tokens,         # counted once per shared page
        "paged_slots": used * bs,
        "paged_waste_slots": used * bs - unique_tokens,
        "contiguous_slots": n * max_context,
        "contiguous_waste_slots": n * max_context - tokens,
        "pages_with_sharing": used,
        "pages_without_sharing": unshared,           # computed: each chat's own ceil(tokens / block_size)
        "pages_saved": unshared - used,
        "pages_saved_by_refcount": snap.pages_saved_by_sharing,  # the snapshot's own count, as a cross-check
        "seqs": per_seq,
    }


def run_engine_level(engine, prompts: list[list[int]], max_tokens: int, progress, tag: str) -> dict:
    """All prompts submitted at once; per-token arrival times, completions, and the peak page snapshot."""
    from pagedchat.engine.sampling import SamplingParams

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    arrivals: list[list[float]] = [[] for _ in prompts]
    peak = {"step": -1, "used": -1, "snap": None}

    def on_update(delta) -> None:  # on the engine thread, between steps
        now = time.perf_counter()
        arrivals[index[delta.request_id]].extend([now] * len(delta.token_ids))
        progress.advance(len(delta.token_ids))
        if engine.steps != peak["step"] and not delta.finished:
            peak["step"] = engine.steps
            used = engine.blocks.num_pages - engine.blocks.num_available()
            # A snapshot of a large pool costs milliseconds of engine time: take one when the page count
            # grows, and in the last steps before replies end, where the most tokens fill the most pages.
            ending = len(arrivals[index[delta.request_id]]) >= max_tokens - 1
            if used > peak["used"] or (used == peak["used"] and ending):
                peak["used"] = used
                peak["snap"] = engine.memory()

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    handles = engine.submit_many(prompts, params, on_update=on_update, request_ids=ids)
    completions = [h.result() for h in handles]
    bad = [c for c in completions if c.finish_reason != "length"]
    if bad:
        raise BenchError(f"request {bad[0].request_id} ended with {bad[0].finish_reason!r}"
                         f"{': ' + bad[0].error if bad[0].error else ''}")
    stats = timing_stats(start, arrivals)
    return {"stats": stats, "completions": completions, "peak": peak["snap"], "arrivals": arrivals}


def ttft_cold_warm(engine, work: Workload, progress) -> dict:
    """A new chat alone: system prompt already cached (warm) against one the cache has never seen (cold)."""
    from pagedchat.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    cold, warm, cached = [], [], []
    for k in range(WARM_REPEATS):
        # A question no chat asked, different from its first token on: only the system prompt can be cached.
        # Cold and warm get the same user turn, so only the prefix differs.
        question = work.user_turn(f"Ticket {k + 1}: {WARM_QUESTION}")
        for kind, prefix in (("cold", work.cold_prefix(100 + k)), ("warm", work.system_ids)):
            t0 = time.perf_counter()
            got = []
            handle = engine.submit(prefix + question, params, request_id=f"ttft-{kind}-{k}",
                                   on_update=lambda d: got.append(time.perf_counter()) if d.token_ids else None)
            c = handle.result()
            (cold if kind == "cold" else warm).append(got[0] - t0)
            if kind == "warm":
                cached.append(c.cached_tokens)
            progress.advance(1)
    c50, w50 = _median(cold), _median(warm)
    return {"repeats": WARM_REPEATS, "prompt_tokens": len(work.system_ids) + len(question),
            "warm_cached_tokens": cached[0], "cold_s": c50, "warm_s": w50, "warm_over_cold": w50 / c50,
            "cold_all_s": cold, "warm_all_s": warm}


# ---- the transformers side -------------------------------------------------------------------------------------
class _TokenClock:
    """A transformers streamer that only records when each generated token (or batch of them) appears."""

    def __init__(self, progress, batch: int):
        self.times: list[float] = []
        self.progress = progress
        self.batch = batch
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.progress.advance(self.batch)

    def end(self) -> None:
        pass


def _make_streamer(progress, batch: int):
    from transformers.generation.streamers import BaseStreamer

    class Clock(_TokenClock, BaseStreamer):
        pass

    return Clock(progress, batch)


def load_transformers(folder, dtype, device):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.to(device).eval()


def _hf_generate(model, batch_ids: list[list[int]], max_tokens: int, pad_id: int, progress):
    import torch

    width = max(len(p) for p in batch_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch_ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_ids], device=model.device)
    clock = _make_streamer(progress, len(batch_ids))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                             streamer=clock)
    if out.shape[1] - width != max_tokens:
        raise BenchError(f"transformers generated {out.shape[1] - width} tokens instead of {max_tokens}")
    return clock.times


def run_one_at_a_time(model, prompts: list[list[int]], max_tokens: int, pad_id: int, progress) -> dict:
    start = time.perf_counter()
    arrivals = [_hf_generate(model, [p], max_tokens, pad_id, progress) for p in prompts]
    return timing_stats(start, arrivals)


def run_padded_batch(model, prompts: list[list[int]], max_tokens: int, pad_id: int, progress) -> dict:
    start = time.perf_counter()
    times = _hf_generate(model, prompts, max_tokens, pad_id, progress)
    return timing_stats(start, [list(times) for _ in prompts])


def median_round(rounds: list[dict]) -> dict:
    """The round with the median end-to-end rate (the lower middle one of an even count)."""
    ranked = sorted(rounds, key=lambda st: st["end_to_end_tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


# ---- the run ---------------------------------------------------------------------------------------------------
def _level_report(n: int, prompts: list[list[int]], res: dict, cost: dict) -> dict:
    """Memory and sharing at one level, from a round's peak snapshot and completions (the same every round)."""
    acct = peak_accounting(res["peak"], cost["max_context"])
    return {
        "chats": n,
        "prompt_tokens": [len(p) for p in prompts],
        "memory_at_peak": acct,
        "sharing": {"pages_with": acct["pages_with_sharing"], "pages_without": acct["pages_without_sharing"],
                    "pages_saved": acct["pages_saved"], "without_is": "computed",
                    "prompt_tokens": sum(len(p) for p in prompts),
                    "prefill_tokens_computed": sum(c.prefilled_tokens for c in res["completions"]),
                    "prefill_tokens_saved": sum(c.cached_tokens for c in res["completions"])},
    }


def run_bench(cfg: BenchConfig, progress=None) -> dict:
    import torch

    progress = progress or _NoProgress()
    torch.manual_seed(cfg.seed)
    levels = sorted(set(cfg.chats))
    top = levels[-1]
    engine = _new_engine(cfg, top, progress.describe)
    try:
        work = build_workload(engine.tokenizer, cfg.system_tokens, top, cfg.seed)
        cost = token_cost(engine)
        longest = max(len(p) for p in work.prompts) + cfg.max_tokens
        if longest > cost["max_context"]:
            raise BenchError(f"a chat would reach {longest} tokens but the model's context holds "
                             f"{cost['max_context']}: lower --system-tokens or --max-tokens")
        need = pages_needed(work.prompts, cfg.max_tokens, cfg.system_tokens, engine.block_size)
        if need > engine.blocks.num_pages:
            per_page = engine.cache_plan.page_bytes
            raise BenchError(
                f"the KV budget holds {engine.blocks.num_pages} pages of {engine.block_size} tokens "
                f"({_size(engine.cache_plan.gpu_bytes)}) but {top} chats of up to {longest} tokens need "
                f"{need} pages even with the system prompt shared: use --kv-cache-memory "
                f"{math.ceil(need * per_page / 2**20)}MiB or more, or fewer --chats / --max-tokens")
        runs = cfg.repeat * (2 if cfg.against else 1) + (1 if cfg.against else 0)
        total = sum(n * cfg.max_tokens for n in levels) * runs + 2 * WARM_REPEATS
        progress.set_total(total)

        hf = None
        if cfg.against == "transformers":
            progress.describe("loading transformers")
            hf = on_own_thread(load_transformers, engine.model_path, engine.dtype, engine.device)
            pad_id = engine.tokenizer.pad_token_id
            pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids or {0})
            on_own_thread(_hf_generate, hf, [work.cold_prefix(1)[:32]], 2, pad_id, _NoProgress())  # warm-up

        report = {
            "command": {"model": cfg.model, "chats": levels, "max_tokens": cfg.max_tokens,
                        "system_tokens": cfg.system_tokens, "seed": cfg.seed, "repeat": cfg.repeat,
                        "against": cfg.against,
                        "kv_cache_memory": cfg.kv_cache_memory, "dtype": cfg.dtype, "device": cfg.device},
            "machine": {"device": str(engine.device), "torch": torch.__version__,
                        "torch_threads": torch.get_num_threads(), "cpu": _cpu_name(),
                        "cpus": os.cpu_count(),
                        "load_average_at_start": _load_average()},
            "model": {"path": str(engine.model_path), "architecture": engine.config.architecture,
                      "dtype": str(engine.dtype).removeprefix("torch.")},
            "workload": {"system_tokens": len(work.system_ids), "user_tokens": [len(p) - len(work.system_ids)
                                                                                 for p in work.prompts],
                         "max_tokens": cfg.max_tokens, "questions": work.questions},
            "token_cost": cost,
            "capacity": capacity(cost, cfg.system_tokens, longest),
            "levels": [],
        }
        for n in levels:
            prompts = work.prompts[:n]
            label = f"{n} chat{'s' * (n > 1)}"
            rounds, first = [], None
            for r in range(cfg.repeat):
                of = f" · round {r + 1} of {cfg.repeat}" if cfg.repeat > 1 else ""
                if engine is None:  # a fresh engine per round: each starts with a cold prefix cache
                    engine = _new_engine(cfg, top, progress.describe)
                _warm_up(engine, work)
                progress.describe(f"pagedchat · {label}{of}")
                res = run_engine_level(engine, prompts, cfg.max_tokens, progress, f"c{n}r{r}")
                first = first or res
                if n == top and r == 0:  # the system prompt is cached now
                    progress.describe("cold vs warm first token")
                    report["ttft_cold_warm"] = ttft_cold_warm(engine, work, progress)
                # Its compute thread ends with it, so transformers runs with no other OpenMP team alive.
                engine.shutdown()
                engine = None
                gc.collect()
                rounds.append({"pagedchat": res["stats"]})
                if hf is not None:
                    progress.describe(f"transformers, padded batch · {label}{of}")
                    rounds[-1]["padded_batch"] = on_own_thread(run_padded_batch, hf, prompts, cfg.max_tokens, pad_id,
                                                               progress)
            level = _level_report(n, prompts, first, cost)
            level["engine"] = median_round([r["pagedchat"] for r in rounds])
            level["rounds"] = rounds
            if hf is not None:
                progress.describe(f"transformers, one at a time · {label}")
                one = on_own_thread(run_one_at_a_time, hf, prompts, cfg.max_tokens, pad_id, progress)
                padded = median_round([r["padded_batch"] for r in rounds])
                level["transformers"] = {"one_at_a_time": one, "padded_batch": padded}
                e2e = level["engine"]["end_to_end_tokens_per_s"]
                level["ratios"] = {"vs_one_at_a_time": e2e / one["end_to_end_tokens_per_s"],
                                   "vs_padded_batch": e2e / padded["end_to_end_tokens_per_s"]}
            report["levels"].append(level)
        report["machine"]["load_average_at_end"] = _load_average()
        return report
    finally:
        if engine is not None:
            engine.shutdown()


def on_own_thread(fn, *args):
    """Run fn on a thread that ends with it, as the engine runs on its own: each runner then computes with the
    only OpenMP team alive in the process (see pagedchat/engine/compute_thread.py)."""
    from pagedchat.engine.compute_thread import ComputeThread

    worker = ComputeThread("pagedchat-bench-transformers")
    try:
        return worker.call(fn, *args)
    finally:
        worker.close()


def _warm_up(engine, work: Workload) -> None:
    """One short request on a prompt that shares no page with the workload: first-call costs off the clock."""
    from pagedchat.engine.sampling import SamplingParams

    engine.generate([work.cold_prefix(0)], SamplingParams(max_tokens=2, ignore_eos=True))


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews every figure here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# ---- the tables ------------------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:,.0f}"


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.1f}"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}".replace(".0 ", " ")
    return f"{n:,.0f} B"


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    groups: list[int] = field(default_factory=list)  # row indexes that start a new group
    left: int = 1                                     # leading columns aligned left


def header_lines(report: dict) -> list[str]:
    m, w = report["machine"], report["workload"]
    lines = [f"pagedchat bench · {report['model']['path']} ({report['model']['dtype']}) on {m['device']} "
             f"({m['cpu']}, {m.get('cpus', '?')} CPUs, {m['torch_threads']} torch threads, torch {m['torch']}) · "
             f"system prompt {w['system_tokens']} tokens, {w['max_tokens']} tokens per reply"]
    repeat = report["command"].get("repeat", 1)
    if repeat > 1:
        lines.append(f"{repeat} rounds of pagedchat and of transformers' padded batch per level, alternating; each "
                     "runner's median round is shown")
    if m.get("load_average_at_start"):
        end = (m.get("load_average_at_end") or ["?"])[0]
        lines.append(f"load average {m['load_average_at_start'][0]} at the start, {end} at the end "
                     "(other work on the machine slows every runner alike)")
    return lines


def sections(report: dict) -> list[Section]:
    cost, cap, levels = report["token_cost"], report["capacity"], report["levels"]
    out = [Section("1. What one token costs", ["source", "KV bytes per token"], [
        [f"model shape: 2 x {cost['num_layers']} layers x {cost['num_kv_heads']} kv heads x {cost['head_dim']} "
         f"head dim x {cost['dtype_bytes']} B ({cost['dtype']})", f"{cost['bytes_per_token_model']:,}"],
        [f"allocated pool: {cost['pool_bytes']:,} B / ({cost['num_pages']:,} pages x {cost['block_size']} slots)",
         f"{cost['bytes_per_token_pool']:,.0f}"],
    ])]

    ps, p, c = cap["paged_shared"], cap["paged"], cap["contiguous"]
    out.append(Section(
        f"2. Capacity: chats of {cap['chat_tokens']} tokens in a {_size(cost['pool_bytes'])} KV budget "
        f"({cost['token_slots']:,} token slots)",
        ["scheme", "slots reserved per chat", "chats that fit", "wasted slots per chat"], [
            [f"paged, system prompt shared ({ps['shared_slots']} slots once)", f"{ps['slots_per_chat']:,}",
             f"{ps['chats']:,}" if ps["chats"] is not None else "-", f"{ps['waste_slots_per_chat']:,}"],
            [f"paged, {cost['block_size']}-token pages, nothing shared", f"{p['slots_per_chat']:,}", f"{p['chats']:,}",
             f"{p['waste_slots_per_chat']:,}"],
            [f"contiguous, full context ({cost['max_context']:,})", f"{c['slots_per_chat']:,}", f"{c['chats']:,}",
             f"{c['waste_slots_per_chat']:,}"],
        ]))

    rows = []
    for lv in levels:
        m = lv["memory_at_peak"]
        held = f"{m['tokens_held']:,}"
        if m["unique_tokens_held"] != m["tokens_held"]:
            held += f" ({m['unique_tokens_held']:,} distinct)"
        rows.append([str(lv["chats"]), held, f"{m['paged_slots']:,}",
                     f"{m['paged_waste_slots']:,} ({_pct(m['paged_waste_slots'], m['paged_slots'])})",
                     f"{m['contiguous_slots']:,}",
                     f"{m['contiguous_waste_slots']:,} ({_pct(m['contiguous_waste_slots'], m['contiguous_slots'])})"])
    out.append(Section("   Waste measured at the run's peak (allocated but unused slots)",
                       ["chats", "tokens held", "paged slots", "paged waste", "contiguous slots", "contiguous waste"],
                       rows, left=0))

    rows = []
    for lv in levels:
        sh = lv["sharing"]
        rows.append([str(lv["chats"]), f"{sh['pages_with']:,}", f"{sh['pages_without']:,}",
                     f"{sh['pages_saved']:,} ({_pct(sh['pages_saved'], sh['pages_without'])})",
                     f"{sh['prompt_tokens']:,}", f"{sh['prefill_tokens_computed']:,}",
                     f"{sh['prefill_tokens_saved']:,} ({_pct(sh['prefill_tokens_saved'], sh['prompt_tokens'])})"])
    out.append(Section(f"3. Sharing one {report['workload']['system_tokens']}-token system prompt (pages at the peak; "
                       "'without' = each chat's own pages, computed)",
                       ["chats", "pages with sharing", "pages without", "saved", "prompt tokens", "prefilled",
                        "prefill saved"], rows, left=0))

    against = any("transformers" in lv for lv in levels)
    cols = ["chats", "runner", "end-to-end tok/s", "decode tok/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95"]
    if against:
        cols.append("pagedchat is")
    rows, groups = [], []

    def row(n, name, st, ratio=None):
        cells = [n, name, _rate(st["end_to_end_tokens_per_s"]), _rate(st["decode_tokens_per_s"]),
                 _ms(st["ttft_p50_s"]), _ms(st["ttft_p95_s"]), _ms(st["itl_p50_s"]), _ms(st["itl_p95_s"])]
        if against:
            cells.append("" if ratio is None else f"{ratio:.2f}x")
        rows.append(cells)

    for lv in levels:
        groups.append(len(rows))
        row(str(lv["chats"]), "pagedchat", lv["engine"])
        if "transformers" in lv:
            row("", "transformers, one at a time", lv["transformers"]["one_at_a_time"],
                lv["ratios"]["vs_one_at_a_time"])
            row("", "transformers, padded batch", lv["transformers"]["padded_batch"], lv["ratios"]["vs_padded_batch"])
    out.append(Section("4. Speed (tokens/s over all chats together; latencies in ms)", cols, rows,
                       groups if against else [], left=2))

    w = report["ttft_cold_warm"]
    out.append(Section(f"   First token of a new chat alone ({w['prompt_tokens']} prompt tokens, median of "
                       f"{w['repeats']})", ["system prompt", "TTFT ms", "prompt tokens from cache"], [
                           ["cold (never seen)", _ms(w["cold_s"]), "0"],
                           ["warm (cached)", _ms(w["warm_s"]), f"{w['warm_cached_tokens']:,}"],
                           ["warm / cold", f"{w['warm_over_cold']:.2f}x", ""]]))
    return out


FOOTNOTE = ("TTFT counts from the moment all chats are submitted: one at a time, later chats wait for the earlier "
            "ones. ITL = time between a chat's consecutive tokens. 'pagedchat is' = pagedchat's end-to-end tok/s "
            "over that runner's.")


def render(report: dict, console) -> None:
    from rich.table import Table

    for line in header_lines(report):
        console.print(line, highlight=False, style=None if line.startswith("pagedchat") else "dim")
    for sec in sections(report):
        t = Table(title=sec.title, title_justify="left")
        for i, col in enumerate(sec.columns):
            t.add_column(col, justify="left" if i < sec.left else "right")
        for i, r in enumerate(sec.rows):
            if i in sec.groups and i:
                t.add_section()
            t.add_row(*r)
        console.print(t)
    if any("transformers" in lv for lv in report["levels"]):
        console.print(FOOTNOTE, style="dim", highlight=False)


def to_markdown(report: dict) -> str:
    """The same tables as GitHub Markdown, for a README."""
    lines = [line + "  " for line in header_lines(report)]
    for sec in sections(report):
        lines += ["", f"**{sec.title.strip()}**", "",
                  "| " + " | ".join(sec.columns) + " |",
                  "|" + "|".join(":---" if i < sec.left else "---:" for i in range(len(sec.columns))) + "|"]
        lines += ["| " + " | ".join(cell or " " for cell in r) + " |" for r in sec.rows]
    if any("transformers" in lv for lv in report["levels"]):
        lines += ["", FOOTNOTE]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m pagedchat.bench ...
    parser = argparse.ArgumentParser(prog="pagedchat bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
