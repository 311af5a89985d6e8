"""`pagedchat bench --prefill 512,2048,8192`: one prompt alone on a cold cache, timed to its first token, at each
length; with `--against llama.cpp`, llama.cpp on the same token ids, rounds alternating. Every prompt starts with a
mark of its own (the workload's cold prefix), so nothing of it is in the prefix cache.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedchat.bench.options import BenchError, write_json


@dataclass(frozen=True)
class PrefillRound:
    runner: str       # "pagedchat" or "llama.cpp"
    tokens: int       # the prompt's length
    seconds: float    # to its first token


@dataclass(frozen=True)
class PrefillReport:
    lengths: list[int]
    runners: list[str]
    rounds: list[PrefillRound]

    def seconds(self, runner: str, tokens: int) -> float:
        return statistics.median(r.seconds for r in self.rounds if r.runner == runner and r.tokens == tokens)

    def tokens_per_s(self, runner: str, tokens: int) -> float:
        return tokens / self.seconds(runner, tokens)

    def over_shortest(self, runner: str, tokens: int) -> float:
        """This length's tokens/s over the shortest prompt's: 1.0 where attention's growing cost is not felt."""
        return self.tokens_per_s(runner, tokens) / self.tokens_per_s(runner, self.lengths[0])

    def to_json(self) -> dict:
        return {**asdict(self), "tokens_per_s": {r: {n: self.tokens_per_s(r, n) for n in self.lengths}
                                                 for r in self.runners}}


def prompts_of(work, lengths: list[int], rounds: int) -> dict[tuple[int, int], list[int]]:
    """A prompt of each length for each round, each with a start of its own: the workload's system prompt made
    long enough (its policy repeated), cut to the length."""
    return {(n, r): work.cold_prefix(1000 + r * len(lengths) + i)[:n]
            for r in range(rounds) for i, n in enumerate(lengths)}


def usable_lengths(lengths: list[int], context: int) -> list[int]:
    """The lengths asked for, each at most the context less the one token generated."""
    fitted = sorted({min(n, context - 1) for n in lengths})
    if fitted[0] < 1:
        raise BenchError(f"the model's context ({context} tokens) holds no prompt")
    return fitted


def engine_first_token(backend, prompt: list[int], request_id: str) -> float:
    from pagedchat.engine.params import SamplingParams

    t0 = time.perf_counter()
    [reply] = backend.submit_ids([prompt], SamplingParams(max_tokens=1, ignore_eos=True), request_ids=[request_id])
    reply.result()
    return time.perf_counter() - t0


def run_prefill_bench(backend, llama, prompts: dict[tuple[int, int], list[int]], lengths: list[int], repeat: int,
                      progress=lambda line: print(line, file=sys.stderr, flush=True)) -> PrefillReport:
    runners = ["pagedchat"] + (["llama.cpp"] if llama is not None else [])
    rounds = []
    for r in range(repeat):
        for n in lengths:
            for runner in runners:
                prompt = prompts[(n, r)]
                seconds = engine_first_token(backend, prompt, f"prefill-{n}-{r}") if runner == "pagedchat" \
                    else llama.cold_first_token([prompt])[0]
                rounds.append(PrefillRound(runner, n, seconds))
                progress(f"round {r + 1}/{repeat} {runner:9s} {n:6d} tokens in {seconds:.2f}s = "
                         f"{n / seconds:.0f} tok/s")
    return PrefillReport(lengths, runners, rounds)


def render(report: PrefillReport) -> str:
    lines = ["one prompt alone, cold, to its first token (median round):",
             "  " + f"{'tokens':>7s}" + "".join(f" {r + ' tok/s':>16s} {'over shortest':>13s}" for r in report.runners)
             + ("  pagedchat over llama.cpp" if len(report.runners) > 1 else "")]
    for n in report.lengths:
        row = f"  {n:7d}" + "".join(f" {report.tokens_per_s(r, n):16.0f} {report.over_shortest(r, n):12.2f}x"
                                    for r in report.runners)
        if len(report.runners) > 1:
            row += f"  {report.tokens_per_s('pagedchat', n) / report.tokens_per_s('llama.cpp', n):24.2f}x"
        lines.append(row)
    return "\n".join(lines)


def run(args) -> int:
    """The `pagedchat bench --prefill` entry point."""
    from pagedchat.backends.local import LocalBackend
    from pagedchat.bench import llamacpp
    from pagedchat.bench.workload import build_workload
    from pagedchat.config import EngineOptions
    from pagedchat.engine.engine import Engine

    if "llama.cpp" in args.against:
        llamacpp.require()
    options = EngineOptions(model=args.model, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                            device=args.device, threads=args.threads)
    engine = Engine(**options.kwargs())
    lengths = usable_lengths(args.prefill, engine.config.max_position_embeddings)
    work = build_workload(engine.tokenizer, lengths[-1], 1, args.seed)
    prompts = prompts_of(work, lengths, args.repeat + 1)
    llama = None
    keep = tempfile.TemporaryDirectory(prefix="pagedchat-bench-gguf-")   # where the default model's GGUF is fetched
    if "llama.cpp" in args.against:
        import torch

        path = llamacpp.gguf_file(args.model, Path(keep.name))
        llama = llamacpp.LlamaCpp(path, args.threads or torch.get_num_threads(), engine.config.vocab_size,
                                  engine.eos_token_ids)
    backend = LocalBackend(engine)
    try:
        # A warm-up round of the shortest prompt, off the clock: first-call costs (kernels, threads) on each runner.
        engine_first_token(backend, prompts[(lengths[0], args.repeat)], "prefill-warm")
        if llama is not None:
            llama.cold_first_token([prompts[(lengths[0], args.repeat)]])
        report = run_prefill_bench(backend, llama, prompts, lengths, args.repeat)
    finally:
        backend.shutdown()
        if llama is not None:
            llama.close()
        keep.cleanup()
    print(render(report))
    write_json(args.json_path, report.to_json())
    return 0
