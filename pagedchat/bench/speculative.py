"""`pagedchat bench --speculation`: decode speed with speculative decoding (n-gram drafts from each chat's own
text, engine/ngram.py) against `speculative="off"`, on the same prompts, greedy, in alternating rounds.

Two workloads: `copy`, requests that copy text already in the conversation (code to edit, a passage to quote),
where drafts are kept; and `chat`, the bench's support questions, where few are. Both engines are loaded once and
stepped by hand in turn, so a round of each runs under the same load; the figures are the median round's. The
greedy tokens of both must be the same (in float32, bit for bit: docs/speculative.md). A measured run is in
docs/bench.md#speculative-decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedchat.bench.options import BenchConfig, BenchError
from pagedchat.bench.stats import median

WORKLOADS = ("chat", "copy")

CODE = '''\
def merge_pages(tables, block_size):
    """Merge the block tables of finished sequences into one list of free pages."""
    free = []
    for table in tables:
        for page in table:
            if page is None:
                continue
            if page not in free:
                free.append(page)
    free.sort()
    return [page * block_size for page in free]
'''

PASSAGE = """\
The paged cache keeps each conversation's keys and values in fixed pages of sixteen tokens. A page that two \
replies share is copied only when one of them writes into it, and a page nobody maps stays cached under the \
hash of its contents until the pool needs it back. When memory runs short, the newest sequence of the busiest \
request is swapped to the host, and brought back when room returns, so that no chat starves the others."""

COPY_REQUESTS = [
    f"Rename the function merge_pages to collect_free_pages and give me the whole function back:\n\n{CODE}",
    f"Quote this paragraph back to me word for word, then say in one line what it is about:\n\n{PASSAGE}",
    f"Add a type hint to every argument of this function and return the full function:\n\n{CODE}",
    f"Repeat the following text exactly, keeping every sentence:\n\n{PASSAGE}",
]


@dataclass(frozen=True)
class Round:
    decode_tokens_per_s: float   # generated tokens after each chat's first, over the time from the first to the last
    tokens: tuple[tuple[int, ...], ...]
    drafted: int
    accepted: int


@dataclass
class Level:
    chats: int
    spec: list[Round] = field(default_factory=list)
    off: list[Round] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return median([s.decode_tokens_per_s / o.decode_tokens_per_s for s, o in zip(self.spec, self.off)])

    @property
    def same_tokens(self) -> bool:
        return all(s.tokens == o.tokens for s, o in zip(self.spec, self.off))


@dataclass(frozen=True)
class SpeculationReport:
    model: str
    workload: str
    mode: str
    levels: list[Level]


def waves_for(engine, workload: str, cfg: BenchConfig, chats: int) -> list[list[list[int]]]:
    """The prompts of a round, in waves of `chats` run together. The copy workload's round asks every copy
    request once at every level (at one chat, four waves of one): the default model copies a passage word for
    word but rewrites code it is asked to edit, so a level that asked only the first request would measure one
    kind of reply."""
    if workload == "copy":
        asked = max(chats, len(COPY_REQUESTS))
        asked += -asked % chats
        requests = [COPY_REQUESTS[i % len(COPY_REQUESTS)] + ("" if i < len(COPY_REQUESTS) else f" ({i})")
                    for i in range(asked)]
        prompts = [engine.encode_prompt([{"role": "user", "content": r}]) for r in requests]
        return [prompts[i:i + chats] for i in range(0, asked, chats)]
    from pagedchat.bench.workload import build_workload

    return [build_workload(engine.tokenizer, cfg.system_tokens, chats, cfg.seed).prompts]


def _round(engine, waves: list[list[list[int]]], max_tokens: int) -> Round:
    """Each wave's chats run together, one wave after another; decode tok/s over the waves' decode spans."""
    from pagedchat import SamplingParams

    before = engine.memory().counters
    decoded, span, tokens = 0, 0.0, []
    for prompts in waves:
        handles = engine.submit_many(prompts, SamplingParams(max_tokens=max_tokens))
        firsts: dict[str, float] = {}
        last = 0.0
        while engine.has_work():
            engine.step()
            now = time.perf_counter()
            for h in handles:
                if h.so_far().generated_tokens and h.request_id not in firsts:
                    firsts[h.request_id] = now
            last = now
        outs = [h.result(timeout=0) for h in handles]
        span += last - max(firsts.values())
        decoded += sum(len(o.token_ids) - 1 for o in outs)
        tokens.extend(tuple(o.token_ids) for o in outs)
    after = engine.memory().counters
    return Round(decoded / span if span > 0 else float("nan"), tuple(tokens),
                 after.drafted - before.drafted, after.accepted - before.accepted)


def run_speculation(cfg: BenchConfig, workload: str, mode: str, progress=None) -> SpeculationReport:
    """Each level of cfg.chats, cfg.repeat rounds of `mode` and of off, alternating."""
    from pagedchat import Engine

    if workload not in WORKLOADS:
        raise BenchError(f"--workload takes {' or '.join(WORKLOADS)} (got {workload!r})")
    if mode == "off":
        raise BenchError("--speculation compares speculation with off: give --speculative auto or ngram")
    kwargs = {**cfg.engine.kwargs(), "max_seqs": max(64, *cfg.chats)}
    engines = {m: Engine(**{**kwargs, "speculative": m}, autostart=False) for m in (mode, "off")}
    try:
        levels = []
        for chats in cfg.chats:
            waves = waves_for(engines["off"], workload, cfg, chats)
            level = Level(chats)
            for r in range(cfg.repeat):
                for m in (mode, "off") if r % 2 == 0 else ("off", mode):
                    if progress:
                        progress(f"{workload}: {chats} chat(s), round {r + 1}/{cfg.repeat}, speculative={m}")
                    (level.off if m == "off" else level.spec).append(_round(engines[m], waves, cfg.max_tokens))
            levels.append(level)
        return SpeculationReport(engines["off"].model_path.name, workload, mode, levels)
    finally:
        for engine in engines.values():
            engine.shutdown()


def render_speculation(report: SpeculationReport) -> str:
    lines = [f"{report.model}: the {report.workload} workload, decode tok/s with speculative={report.mode} "
             "against off (median round)"]
    for level in report.levels:
        spec = median([r.decode_tokens_per_s for r in level.spec])
        off = median([r.decode_tokens_per_s for r in level.off])
        drafted = sum(r.drafted for r in level.spec)
        accepted = sum(r.accepted for r in level.spec)
        rate = f"{accepted}/{drafted} drafts kept" if drafted else "no drafts"
        lines.append(f"  {level.chats:>3} chat(s)  {spec:8.1f} vs {off:8.1f} tok/s  {level.ratio:5.2f}x  "
                     f"{rate}  same tokens: {'yes' if level.same_tokens else 'NO'}")
    return "\n".join(lines)
