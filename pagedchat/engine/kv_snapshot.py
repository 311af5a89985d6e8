"""A read-only picture of the KV cache, taken between engine steps, for the inspector and the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from typing import TYPE_CHECKING

from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.pages import MemoryCounters
from pagedchat.engine.page_groups import PageGroups
from pagedchat.engine.records import PageState
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.records import NULL_PAGE
from pagedchat.engine.sequence import Sequence

if TYPE_CHECKING:  # sizing imports torch; a snapshot read back over HTTP needs none
    from pagedchat.engine.sizing import CachePlan, GroupPlan


@dataclass(frozen=True)
class PoolUsage:
    """Two counts, cheap enough to read at every update (a MemorySnapshot of a large pool is not)."""

    steps: int        # engine steps that ran a forward pass so far
    pages_used: int   # pages mapped by live sequences or pinned for a copy (the first layer group's)
    bytes_used: int = 0  # those pages' bytes, in every layer group


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
class GroupMemory:
    """One layer group's pool (engine/page_groups.py). Groups' pages differ in size, so they compare in bytes."""

    window: int | None        # the sliding window its pages are released by; None: its layers keep every page
    layers: int
    num_pages: int
    used_pages: int           # mapped by live sequences or pinned for a copy
    cached_pages: int         # unmapped, holding reusable content
    page_bytes: int
    released_pages: int       # live sequences' blocks whose page the window released (each sequence's own)
    released_total: int       # pages released by the window since the engine started

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def released_bytes(self) -> int:
        """What the released blocks of live sequences would hold had their pages been kept."""
        return self.released_pages * self.page_bytes


@dataclass(frozen=True)
class MemorySnapshot:
    num_pages: int
    free_pages: int           # pages a new request can take: empty ones plus cached ones (reclaimable)
    cached_pages: int         # of free_pages, those still holding reusable content
    block_size: int           # tokens per page
    page_bytes: int
    ref_counts: dict[int, int]            # page -> reference count, pages in use only
    page_states: list[PageState]          # per page
    shared_pages: dict[int, list[str]]    # pages mapped by two or more sequences -> their request ids
    seqs: dict[str, SequenceMemory]       # request id -> its tokens and pages
    cpu_total: int
    cpu_cached: int           # cached pages offloaded to the CPU tier
    cpu_swapped: int          # pages of swapped-out sequences
    counters: MemoryCounters  # a copy, taken with the snapshot
    hit_rate: float           # prefix cache, all admissions so far
    recent_hit_rate: float    # prefix cache, the last 64 admissions
    live_tokens: int          # tokens held by live sequences
    contiguous_bytes: int     # what reserving the model's full context per live sequence would take
    weight_bytes: int = 0     # the model's resident weights, which share the memory with the pool (0: unknown)
    weight_precision: str = ""  # how they run, e.g. "Q4_1 as int4 + Q8_0 as 2×int4" ("": unknown)
    kv_dtype: str = ""        # the pages' dtype, kv_cache_dtype's choice ("": unknown)
    kv_token_bytes: int = 0   # K and V of one token in every layer, in that dtype (0: unknown)
    # Every layer group's pool, the first one's being the pages above (one group: a model without windows, or
    # a server that does not say).
    groups: tuple[GroupMemory, ...] = ()

    def to_json(self) -> dict:
        """Plain JSON types (page states as their names; the page-keyed maps get string keys), as `pagedchat
        serve` sends it at /v1/memory."""
        data = asdict(self)
        data["page_states"] = [state.value for state in self.page_states]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "MemorySnapshot":
        """The inverse of to_json, for a snapshot read back over HTTP (also from a server that still sends the
        older names)."""
        fields = {_OLD_NAMES.get(k, k): v for k, v in data.items() if k != "sequences"}
        fields["ref_counts"] = {int(p): r for p, r in data["ref_counts"].items()}
        fields["shared_pages"] = {int(p): ids for p, ids in data["shared_pages"].items()}
        fields["seqs"] = {rid: SequenceMemory(**s) for rid, s in data["seqs"].items()}
        fields["page_states"] = [PageState(state) for state in data["page_states"]]
        fields["counters"] = MemoryCounters(**data["counters"])
        fields["groups"] = tuple(GroupMemory(**g) for g in data.get("groups", ()))
        return cls(**fields)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def cpu_used(self) -> int:
        return self.cpu_cached + self.cpu_swapped

    @property
    def pages_saved_by_sharing(self) -> int:
        """Pages that would exist if every sequence had its own copy."""
        return sum(count - 1 for count in self.ref_counts.values())

    @property
    def paged_bytes(self) -> int:
        """The bytes of the pages in use, in every layer group."""
        if self.groups:
            return sum(g.used_bytes for g in self.groups)
        return self.used_pages * self.page_bytes

    @property
    def pool_bytes(self) -> int:
        """The bytes of every page, in every layer group."""
        if self.groups:
            return sum(g.num_pages * g.page_bytes for g in self.groups)
        return self.num_pages * self.page_bytes

    @property
    def window_released_bytes(self) -> int:
        """What live sequences would hold more, had their windows' passed pages been kept."""
        return sum(g.released_bytes for g in self.groups)


# /v1/memory's field names from servers older than the page/block naming; their "sequences" duplicated
# the pages in seqs and is dropped.
_OLD_NAMES = {"total_blocks": "num_pages", "free_blocks": "free_pages", "cached_blocks": "cached_pages"}


def _rate(queried: int, hit: int) -> float:
    return hit / queried if queried else 0.0


def snapshot(pages: PageGroups, scheduler: Scheduler, max_context: int, plan: CachePlan,
             weight_bytes: int = 0, weight_precision: str = "", kv_dtype: str = "") -> MemorySnapshot:
    block_manager = pages.first
    seqs = scheduler.all_seqs()
    group = block_manager.group  # the first group's tables: what the snapshot describes
    owners: dict[int, list[str]] = {}
    for seq in seqs:
        for page in seq.table(group).block_table:
            if page != NULL_PAGE:
                owners.setdefault(page, []).append(seq.request_id)
    recent = list(block_manager.prefix.recent_lookups)
    counters = replace(block_manager.counters)
    return MemorySnapshot(
        num_pages=block_manager.num_pages,
        free_pages=block_manager.pool.num_available(),
        cached_pages=block_manager.pool.num_cached(),
        block_size=block_manager.block_size,
        page_bytes=plan.groups[0].page_bytes,
        ref_counts=block_manager.pool.ref_counts(),
        page_states=block_manager.pool.page_states(),
        shared_pages={p: ids for p, ids in owners.items() if len(ids) > 1},
        seqs={s.request_id: SequenceMemory(s.request_id, s.status.value, len(s.token_ids), s.num_computed,
                                           list(s.table(group).block_table), len(s.table(group).cpu_table),
                                           s.cached_tokens) for s in seqs},
        cpu_total=block_manager.cpu.num_pages,
        cpu_cached=block_manager.cpu.num_cached(),
        cpu_swapped=block_manager.cpu.num_held(),
        counters=counters,
        hit_rate=_rate(counters.prefix_queries, counters.prefix_hits),
        recent_hit_rate=_rate(sum(q for q, _ in recent), sum(h for _, h in recent)),
        live_tokens=sum(len(s.token_ids) for s in seqs),
        contiguous_bytes=len(seqs) * max_context * plan.page_bytes // block_manager.block_size,
        weight_bytes=weight_bytes,
        weight_precision=weight_precision,
        kv_dtype=kv_dtype,
        kv_token_bytes=plan.page_bytes // block_manager.block_size,
        groups=tuple(_group(manager, layout, seqs) for manager, layout in zip(pages.groups, plan.groups)),
    )


def _group(manager: BlockManager, layout: GroupPlan, seqs: list[Sequence]) -> GroupMemory:
    released = sum(table.count(NULL_PAGE) for s in seqs
                   for table in (s.table(manager.group).block_table, s.table(manager.group).cpu_table))
    return GroupMemory(window=layout.window, layers=len(layout.layers), num_pages=manager.num_pages,
                       used_pages=manager.num_pages - manager.pool.num_available(),
                       cached_pages=manager.pool.num_cached(),
                       page_bytes=layout.page_bytes, released_pages=released,
                       released_total=manager.counters.window_released)
