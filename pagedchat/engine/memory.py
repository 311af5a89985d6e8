"""A read-only picture of the KV cache, taken between engine steps, for the inspector and the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.scheduler import Scheduler


@dataclass(frozen=True)
class SequenceMemory:
    request_id: str
    status: str               # waiting, running, swapped
    num_tokens: int
    num_computed: int
    pages: list[int]          # physical GPU pages in logical order
    cpu_pages: int            # pages parked in the CPU tier while swapped
    cached_tokens: int


@dataclass(frozen=True)
class MemorySnapshot:
    total_blocks: int
    free_blocks: int          # pages a new request can take: empty ones plus cached ones (reclaimable)
    cached_blocks: int        # of free_blocks, those still holding reusable content
    block_size: int
    page_bytes: int
    sequences: dict[str, list[int]]       # request id -> physical pages in logical order
    ref_counts: dict[int, int]            # page -> reference count, pages in use only
    page_states: list[str]                # per page: free, used or cached
    shared_pages: dict[int, list[str]]    # pages mapped by two or more sequences -> their request ids
    seqs: dict[str, SequenceMemory]
    cpu_total: int
    cpu_cached: int           # cached pages offloaded to the CPU tier
    cpu_swapped: int          # pages of swapped-out sequences
    counters: dict[str, int]
    hit_rate: float           # prefix cache, all admissions so far
    recent_hit_rate: float    # prefix cache, the last 64 admissions
    live_tokens: int          # tokens held by live sequences
    contiguous_bytes: int     # what reserving the model's full context per live sequence would take
    weight_bytes: int = 0     # the model's resident weights, which share the memory with the pool (0: unknown)
    weight_precision: str = ""  # how they run, e.g. "Q4_1 as int4 + Q8_0 as 2×int4" ("": unknown)

    def to_json(self) -> dict:
        """Plain JSON types (the page-keyed maps get string keys), as `pagedchat serve` sends it at /v1/memory."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "MemorySnapshot":
        """The inverse of to_json, for a snapshot read back over HTTP."""
        fields = dict(data)
        fields["ref_counts"] = {int(p): r for p, r in data["ref_counts"].items()}
        fields["shared_pages"] = {int(p): ids for p, ids in data["shared_pages"].items()}
        fields["seqs"] = {rid: SequenceMemory(**s) for rid, s in data["seqs"].items()}
        return cls(**fields)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def cpu_used(self) -> int:
        return self.cpu_cached + self.cpu_swapped

    @property
    def pages_saved_by_sharing(self) -> int:
        """Pages that would exist if every sequence had its own copy."""
        return sum(count - 1 for count in self.ref_counts.values())

    @property
    def paged_bytes(self) -> int:
        return self.used_blocks * self.page_bytes


def _rate(queried: int, hit: int) -> float:
    return hit / queried if queried else 0.0


def snapshot(blocks: BlockManager, scheduler: Scheduler, max_context: int, page_bytes: int,
             weight_bytes: int = 0, weight_precision: str = "") -> MemorySnapshot:
    seqs = scheduler.all_seqs()
    owners: dict[int, list[str]] = {}
    for seq in seqs:
        for page in seq.block_table:
            owners.setdefault(page, []).append(seq.request_id)
    recent = list(blocks.recent_lookups)
    counters = asdict(blocks.counters)
    return MemorySnapshot(
        total_blocks=blocks.num_pages,
        free_blocks=blocks.num_available(),
        cached_blocks=len(blocks.evictable),
        block_size=blocks.block_size,
        page_bytes=page_bytes,
        sequences={s.request_id: list(s.block_table) for s in seqs},
        ref_counts=blocks.ref_counts(),
        page_states=[state.value for state in blocks.page_states()],
        shared_pages={p: ids for p, ids in owners.items() if len(ids) > 1},
        seqs={s.request_id: SequenceMemory(s.request_id, s.status.value, len(s.token_ids), s.num_computed,
                                           list(s.block_table), len(s.cpu_table), s.cached_tokens) for s in seqs},
        cpu_total=blocks.cpu.num_pages,
        cpu_cached=blocks.cpu.num_cached(),
        cpu_swapped=blocks.cpu.num_held(),
        counters=counters,
        hit_rate=_rate(counters["prefix_queries"], counters["prefix_hits"]),
        recent_hit_rate=_rate(sum(q for q, _ in recent), sum(h for _, h in recent)),
        live_tokens=sum(len(s.token_ids) for s in seqs),
        contiguous_bytes=len(seqs) * max_context * page_bytes // blocks.block_size,
        weight_bytes=weight_bytes,
        weight_precision=weight_precision,
    )
