"""`pagedchat bench --windows`: the KV memory one long chat takes on a model with sliding-window layers, with
the window layers' passed pages released (the engine's default) and kept (what a contiguous cache must do).

Both runs step the same engine settings by hand, so the peak is read after every step: the bytes of the pages
in use in every layer group (engine/page_groups.py). docs/bench.md#sliding-window-pages---windows holds a
measured run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedchat.bench.options import BenchConfig, BenchError
from pagedchat.bench.render import size

PROMPT_TEXT = "The paged cache keeps each chat's keys and values in pages of sixteen tokens. "


@dataclass(frozen=True)
class WindowRun:
    released: bool          # the window layers' passed pages released (True) or kept
    peak_bytes: int         # KV bytes in use at the run's peak, every layer group
    group_peaks: tuple[int, ...]  # each group's peak bytes, in the engine's group order
    seconds: float


@dataclass(frozen=True)
class WindowReport:
    model: str
    groups: tuple[str, ...]  # each layer group: "5 layers, window 512" or "1 layer, global"
    tokens: int              # the chat's length: prompt and reply
    kept: WindowRun
    released: WindowRun

    @property
    def ratio(self) -> float:
        return self.kept.peak_bytes / self.released.peak_bytes


def run_windows(cfg: BenchConfig, progress=None) -> WindowReport:
    """One chat of cfg.system_tokens prompt tokens and cfg.max_tokens forced reply tokens, run twice."""
    runs = [_run(cfg, release, progress) for release in (False, True)]
    (kept, groups, tokens, model), (released, _, _, _) = runs
    return WindowReport(model, groups, tokens, kept, released)


def _run(cfg: BenchConfig, release: bool, progress) -> tuple[WindowRun, tuple[str, ...], int, str]:
    from pagedchat import Engine, SamplingParams

    engine = Engine(**cfg.engine.kwargs(), autostart=False, release_windows=release)
    try:
        layers = [spec.window for spec in engine.config.layers]
        if not any(layers):
            raise BenchError(f"{engine.model_path.name} has no sliding-window layers: --windows needs a model with "
                             "some (Gemma 3, Mistral, Phi-3 with a window)")
        if progress:
            progress(f"one {cfg.system_tokens + cfg.max_tokens}-token chat, window pages "
                     f"{'released' if release else 'kept'}")
        prompt = engine.tokenizer.encode(PROMPT_TEXT * (cfg.system_tokens // 8 + 1))[:cfg.system_tokens]
        engine.submit(prompt, SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True))
        plan = engine.cache_plan
        peak, group_peaks = 0, [0] * len(plan.groups)
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
            peak = max(peak, engine.usage().bytes_used)
            used = engine.pages.pages_used()
            group_peaks = [max(p, n * g.page_bytes) for p, n, g in zip(group_peaks, used, plan.groups)]
        seconds = time.perf_counter() - start
        groups = tuple(_describe(layers, w) for w in dict.fromkeys(sorted(layers, key=lambda w: w or 0)))
        run = WindowRun(release, peak, tuple(group_peaks), seconds)
        return run, groups, len(prompt) + cfg.max_tokens, engine.model_path.name
    finally:
        engine.shutdown()


def _describe(layers: list[int | None], window: int | None) -> str:
    n = layers.count(window)
    return f"{n} layer{'' if n == 1 else 's'}, " + ("global" if window is None else f"window {window}")


def render_windows(report: WindowReport) -> str:
    """The report as the bench prints it (and as docs/bench.md quotes it)."""
    lines = [f"{report.model}: one {report.tokens}-token chat; layers: {'; '.join(report.groups)}"]
    for run in (report.kept, report.released):
        by_group = " + ".join(size(b) for b in run.group_peaks)
        kind = "released" if run.released else "kept"
        lines.append(f"  window pages {kind:<8}  peak KV {size(run.peak_bytes):>10}  (by group {by_group}; "
                     f"{run.seconds:.1f} s)")
    lines.append(f"  released: {report.ratio:.2f}x less KV memory at the peak")
    return "\n".join(lines)
