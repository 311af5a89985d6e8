"""The bench's report: every figure of one run, typed; `to_json` gives the same tree as plain JSON values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedchat.bench.options import BenchConfig
from pagedchat.bench.engine_runner import ColdWarm
from pagedchat.bench.capacity import Capacity, DtypeCapacity, PeakAccounting, Sharing, TokenCost, WeightCapacity
from pagedchat.bench.stats import RunStats, median

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
    read_bandwidth: float | None = None  # bytes/s a big torch.sum reads on every core, in huge pages, at the start
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
    # The read bandwidth in huge pages just before the round and just after it, at one chat (bandwidth.py).
    read_bandwidth: tuple[float, float] | None = None

    def bandwidth_share(self, weight_bytes: int) -> float | None:
        """The share of the bandwidth around the round that its decode reached, reading weight_bytes a token."""
        from pagedchat.bench.bandwidth import share

        if self.read_bandwidth is None:
            return None
        return share(weight_bytes, self.stats.decode_tokens_per_s, sum(self.read_bandwidth) / 2)


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
        """(label, share) of each alternating runner's one-chat decode in the read bandwidth: the weights' bytes
        read per token times its tokens/s, over the bandwidth measured around the same round, the median of its
        rounds. On some machines the bandwidth moves from one second to the next, so a share is taken against a
        measure of the moment. None without a one-chat level or measured bandwidths."""
        one = next((lv for lv in self.levels if lv.chats == 1), None)
        if one is None:
            return []
        labels = {PAGEDCHAT: PAGEDCHAT, **{p.runner: p.label for p in one.peers}}
        out = []
        for key, label in labels.items():
            shares = [s for rnd in one.rounds for res in rnd if res.runner == key
                      if (s := res.bandwidth_share(self.weights.weight_bytes)) is not None]
            if shares:
                out.append((label, median(shares)))
        return out

    def round_bandwidths(self) -> list[float]:
        """Every read bandwidth measured around the one-chat rounds, in bytes/s."""
        return [bw for lv in self.levels for rnd in lv.rounds for res in rnd for bw in res.read_bandwidth or ()]

    @property
    def peer_labels(self) -> list[tuple[str, str]]:
        """(key, label) of every peer runner, in table order."""
        return [(p.runner, p.label) for p in self.levels[0].peers] if self.levels else []


def to_json(report: Report) -> dict:
    return dataclasses.asdict(report)
