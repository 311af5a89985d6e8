"""One bench run: the workload on pagedchat and on each peer, level by level, rounds alternating."""

from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path
from typing import Callable, Mapping

from pagedchat.backends.local import LocalBackend
from pagedchat.bench.bandwidth import read_bandwidth, read_bandwidths
from pagedchat.bench.options import BenchConfig, BenchError
from pagedchat.bench.engine_runner import (WARM_REPEATS, EngineRun, cold_prompts, engine_kwargs, new_engine,
                                           run_engine_level, ttft_cold_warm, warm_up)
from pagedchat.bench.capacity import (TokenCost, capacity, dtype_capacity, pages_needed, parameter_count,
                                    token_cost, weight_capacity)
from pagedchat.bench.loaders import LOADERS
from pagedchat.bench.peers import Peer, Runner
from pagedchat.bench.progress import NoProgress
from pagedchat.bench.report import (PAGEDCHAT, Level, Machine, ModelInfo, PeerFigures, Report, RoundResult, Timed,
                                    WorkloadInfo)
from pagedchat.bench.startup import ENGINE_READY, time_to_ready
from pagedchat.bench.stats import median, median_round, ratio
from pagedchat.bench.workload import Workload, build_workload

# The engine's own cap on a default pool: never more than 16 sequences at full context would use
# (pagedchat/engine/sizing.py, plan_cache).
DEFAULT_POOL_CONTEXTS = 16


def run_bench(cfg: BenchConfig, progress=None, loaders: Mapping[str, Callable[..., Peer]] = LOADERS) -> Report:
    import torch

    from pagedchat.model import qmm

    progress = progress or NoProgress()
    torch.manual_seed(cfg.seed)
    levels = sorted(set(cfg.chats))
    top = levels[-1]
    machine_start = _load_average()
    engine = new_engine(cfg, top, progress.describe)
    peers: list[Peer] = []
    try:
        work = build_workload(engine.tokenizer, cfg.system_tokens, top, cfg.seed)
        cost = token_cost(engine.config, engine.kv_dtype, LocalBackend(engine).info)
        longest = max(len(p) for p in work.prompts) + cfg.max_tokens
        _check_fits(work, cfg, cost, top, longest)
        weights = _weights(engine, cost)
        for name in cfg.against:
            progress.describe(f"loading {name}")
            peers.append(loaders[name](cfg, engine, work))
        # after every check of the options: a bad one is refused without seconds of measuring first
        bandwidth, bandwidth_torch = read_bandwidths() if cfg.bandwidth else (None, None)
        every = [r for p in peers for r in p.runners if r.every_round]
        once = [r for p in peers for r in p.runners if not r.every_round]
        runs = cfg.repeat * (1 + len(every)) + len(once)
        progress.set_total(sum(n * cfg.max_tokens for n in levels) * runs + 2 * WARM_REPEATS)
        paths = engine.model.run_paths()
        kernels = "; ".join(paths.projections)
        base = dict(config=cfg, model=ModelInfo(str(engine.model_path), engine.config.architecture,
                                                str(engine.dtype).removeprefix("torch."),
                                                engine.model.weight_precision, kernels,
                                                paths.attention),
                    peer_builds=tuple(f"{p.name}: {p.build}" for p in peers if p.build),
                    workload=WorkloadInfo(len(work.system_ids), tuple(len(p) - len(work.system_ids)
                                                                      for p in work.prompts),
                                          cfg.max_tokens, tuple(work.questions)),
                    token_cost=cost, capacity=capacity(cost, cfg.system_tokens, longest), weights=weights,
                    page_dtypes=dtype_capacity(engine.config, cost.pool_bytes, cost.block_size))
        device = str(engine.device)
        out_levels, cold_warm = [], None
        for n in levels:
            level, engine, cw = _run_level(cfg, n, top, work, engine, every, once, progress)
            out_levels.append(level)
            cold_warm = cold_warm or cw
        cold = _cold_first_tokens(work, cold_warm, peers, progress)
        startup = startup_times(cfg, top, peers, progress) if cfg.startup else ()
        machine = Machine(device=device, torch=torch.__version__, torch_threads=cfg.threads or torch.get_num_threads(),
                          cpu=_cpu_name(), cpus=os.cpu_count(), load_average_at_start=machine_start,
                          load_average_at_end=_load_average(), cpu_level=qmm.best_label(),
                          torch_level=torch.backends.cpu.get_cpu_capability(), read_bandwidth=bandwidth,
                          read_bandwidth_torch=bandwidth_torch)
        return Report(machine=machine, ttft_cold_warm=cold_warm, cold_first_token=cold, startup=startup,
                      levels=tuple(out_levels), **base)
    finally:
        if engine is not None:
            engine.shutdown()
        for peer in peers:
            peer.close()


def _check_fits(work: Workload, cfg: BenchConfig, cost: TokenCost, top: int, longest: int) -> None:
    if longest > cost.max_context:
        raise BenchError(f"a chat would reach {longest} tokens but the model's context holds "
                         f"{cost.max_context}: lower --system-tokens or --max-tokens")
    need = pages_needed(work.prompts, cfg.max_tokens, cfg.system_tokens, cost.block_size)
    if need > cost.num_pages:
        from pagedchat.bench.render import size

        raise BenchError(
            f"the KV budget holds {cost.num_pages} pages of {cost.block_size} tokens "
            f"({size(cost.pool_bytes)}) but {top} chats of up to {longest} tokens need "
            f"{need} pages even with the system prompt shared: use --kv-cache-memory "
            f"{math.ceil(need * cost.page_bytes / 2**20)}MiB or more, or fewer --chats / --max-tokens")


def _weights(engine, cost: TokenCost):
    """The loaded weights beside the pool, from the model's own numbers."""
    import torch

    resident = engine.weight_bytes
    gpu_free = None
    if engine.device.type == "cuda":  # free before this engine loaded: what plan_cache started from
        gpu_free = torch.cuda.mem_get_info(engine.device)[0] + resident + cost.pool_bytes
    ceiling = DEFAULT_POOL_CONTEXTS * cost.max_context * cost.bytes_per_token_model
    return weight_capacity(parameter_count(engine.config), resident, cost, ceiling, gpu_free)


def _run_level(cfg: BenchConfig, n: int, top: int, work: Workload, engine, every: list[Runner], once: list[Runner],
               progress):
    """One level's rounds, pagedchat and each every-round peer in turn, then the once-per-level peers.
    Returns the level, the engine left alive (None: the next round makes a fresh one), and the cold/warm first
    token when this level measured it."""
    prompts = work.prompts[:n]
    label = f"{n} chat{'s' * (n > 1)}"
    rounds, first, cold_warm = [], None, None
    gauged = n == 1 and cfg.bandwidth  # one chat's decode is bound by memory: its share, round by round
    for r in range(cfg.repeat):
        of = f" · round {r + 1} of {cfg.repeat}" if cfg.repeat > 1 else ""
        if engine is None:  # a fresh engine per round: each starts with a cold prefix cache
            engine = new_engine(cfg, top, progress.describe)
        backend = LocalBackend(engine)
        warm_up(backend, work)
        progress.describe(f"{PAGEDCHAT} · {label}{of}")
        before = _gauge(gauged)
        run: EngineRun = run_engine_level(backend, prompts, cfg.max_tokens, progress, f"c{n}r{r}")
        first = first or run
        if n == top and r == 0:  # the system prompt is cached now
            progress.describe("cold vs warm first token")
            cold_warm = ttft_cold_warm(backend, work, progress)
        # Its compute thread ends with it, so each peer runs with no other OpenMP team alive.
        engine.shutdown()
        engine = None
        gc.collect()
        after = _gauge(gauged)
        results = [RoundResult(PAGEDCHAT, run.stats, _pair(before, after))]
        for runner in every:
            progress.describe(f"{runner.label} · {label}{of}")
            stats = runner.run(prompts, cfg.max_tokens, progress)
            before, after = after, _gauge(gauged)
            results.append(RoundResult(runner.key, stats, _pair(before, after)))
        rounds.append(tuple(results))
    ours = median_round([rnd[0].stats for rnd in rounds])
    figures = []
    for runner in every + once:
        if runner.every_round:
            stats = median_round([res.stats for rnd in rounds for res in rnd if res.runner == runner.key])
        else:
            progress.describe(f"{runner.label} · {label}")
            stats = runner.run(prompts, cfg.max_tokens, progress)
        figures.append(PeerFigures(runner.key, runner.label, runner.every_round, stats,
                                   ratio(ours.end_to_end_tokens_per_s, stats.end_to_end_tokens_per_s),
                                   ratio(ours.decode_tokens_per_s, stats.decode_tokens_per_s)))
    level = Level(chats=n, prompt_tokens=tuple(len(p) for p in prompts), memory_at_peak=first.peak,
                  sharing=first.sharing, engine=ours, peers=tuple(figures), rounds=tuple(rounds))
    return level, engine, cold_warm


def _gauge(on: bool) -> float | None:
    """The read bandwidth in huge pages now, where on: on some machines it moves from one second to the next."""
    return read_bandwidth(huge_pages=True) if on else None


def _pair(before: float | None, after: float | None) -> tuple[float, float] | None:
    return None if before is None or after is None else (before, after)


def _cold_first_tokens(work: Workload, cold_warm, peers: list[Peer], progress) -> tuple[Timed, ...]:
    """pagedchat's cold first token (from the cold/warm measurement) beside each peer's, on the same prompts."""
    out = [Timed(PAGEDCHAT, PAGEDCHAT, cold_warm.cold_s, cold_warm.cold_all_s)]
    prompts = [prefix + turn for prefix, turn in cold_prompts(work)]
    for peer in peers:
        if peer.cold_first_token is not None:
            progress.describe(f"{peer.name} · cold first token")
            times = tuple(peer.cold_first_token(prompts))
            out.append(Timed(peer.name, peer.name, median(times), times))
    return tuple(out)


def startup_times(cfg: BenchConfig, top: int, peers: list[Peer], progress) -> tuple[Timed, ...]:
    """Start to model ready in fresh processes, with the model cached; --repeat rounds, runners alternating."""
    probes = [(PAGEDCHAT, lambda: time_to_ready(["-c", ENGINE_READY, json.dumps(engine_kwargs(cfg, top))]))]
    probes += [(p.name, p.startup) for p in peers if p.startup is not None]
    times: dict[str, list[float]] = {name: [] for name, _ in probes}
    for _ in range(cfg.repeat):
        for name, probe in probes:
            progress.describe(f"start to model ready · {name}")
            times[name].append(probe())
    return tuple(Timed(name, name, median(ts), tuple(ts)) for name, ts in times.items())


def _load_average() -> tuple[float, ...] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews every figure here."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
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
