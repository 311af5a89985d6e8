"""The bench's report: every figure of one run, typed; `to_json` gives the same tree as plain JSON values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedchat.bench.options import BenchConfig
from pagedchat.bench.engine_runner import ColdWarm
from pagedchat.bench.capacity import Capacity, DtypeCapacity, PeakAccounting, Sharing, TokenCost, WeightCapacity
from pagedchat.bench.stats import RunStats

PAGEDCHAT = "pagedchat"  # the runner key of pagedchat's own rounds


@dataclass(frozen=True)
class Machine:
    device: str
    torch: str
    torch_threads: int
    cpu: str
    cpus: int | None
    load_average_at_start: tuple[float, ...] | None
    load_average_at_end: tuple[float, ...] | None
    cpu_level: str = ""  # the best level of pagedchat's kernels this CPU runs ("": not built)
    torch_level: str = ""  # the level torch's own CPU kernels run at (SDPA, ...): ATEN_CPU_CAPABILITY lowers it
    read_bandwidth: float | None = None  # bytes/s a big torch.sum reads on every core, in huge pages (bandwidth.py)
    read_bandwidth_torch: float | None = None  # the same from torch's own allocation; None where no huge pages


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    dtype: str
    weights: str = ""  # what the weights are and how they run: "Q4_1 packed + Q8_0 packed · AVX2"
    kernels: str = ""  # what ran the projections, by kernel (DecoderModel.run_paths)
    attention: str = ""  # what ran attention (attention.describe)


@dataclass(frozen=True)
class WorkloadInfo:
    system_tokens: int
    user_tokens: tuple[int, ...]
    max_tokens: int
    questions: tuple[str, ...]


@dataclass(frozen=True)
class RoundResult:
    runner: str        # PAGEDCHAT or a peer runner's key
    stats: RunStats


@dataclass(frozen=True)
class PeerFigures:
    """A peer runner's median round at one level, and pagedchat's figures over its."""

    runner: str
    label: str
    every_round: bool  # alternated with pagedchat's rounds (else run once per level)
    stats: RunStats
    end_to_end_ratio: float | None
    decode_ratio: float | None


@dataclass(frozen=True)
class Level:
    chats: int
    prompt_tokens: tuple[int, ...]
    memory_at_peak: PeakAccounting
    sharing: Sharing
    engine: RunStats                              # pagedchat's median round
    peers: tuple[PeerFigures, ...]
    rounds: tuple[tuple[RoundResult, ...], ...]   # every round, in the order run

    def peer(self, runner: str) -> PeerFigures:
        return next(p for p in self.peers if p.runner == runner)


@dataclass(frozen=True)
class Timed:
    """One runner's figure measured several times: the median, and every time in the order taken."""

    runner: str
    label: str
    median_s: float
    all_s: tuple[float, ...]


@dataclass(frozen=True)
class Report:
    config: BenchConfig
    machine: Machine
    model: ModelInfo
    workload: WorkloadInfo
    token_cost: TokenCost
    capacity: Capacity
    weights: WeightCapacity
    ttft_cold_warm: ColdWarm
    cold_first_token: tuple[Timed, ...]   # pagedchat's cold prompt first, then each peer's, same prompts
    startup: tuple[Timed, ...]            # start to model ready, pagedchat first; empty when not measured
    levels: tuple[Level, ...]
    peer_builds: tuple[str, ...] = ()  # how each peer was built, where it says ("llama.cpp: AVX2 FMA ...")
    page_dtypes: tuple[DtypeCapacity, ...] = ()  # every kv_cache_dtype in this run's KV budget

    def bandwidth_shares(self) -> list[tuple[str, float]]:
        """(label, share) of each runner's one-chat decode in the measured read bandwidth: the weights' bytes
        read per token times its tokens/s; none without a one-chat level or a measured bandwidth."""
        from pagedchat.bench.bandwidth import share

        one = next((lv for lv in self.levels if lv.chats == 1), None)
        if one is None:
            return []
        runners = [(PAGEDCHAT, one.engine)] + [(p.label, p.stats) for p in one.peers]
        shares = [(label, share(self.weights.weight_bytes, stats.decode_tokens_per_s, self.machine.read_bandwidth))
                  for label, stats in runners]
        return [(label, s) for label, s in shares if s is not None]

    @property
    def peer_labels(self) -> list[tuple[str, str]]:
        """(key, label) of every peer runner, in table order."""
        return [(p.runner, p.label) for p in self.levels[0].peers] if self.levels else []


def to_json(report: Report) -> dict:
    return dataclasses.asdict(report)
