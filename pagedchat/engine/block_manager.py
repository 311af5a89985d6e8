"""Physical KV pages: who maps them, what they hold, and where they live.

A page is USED while some block table maps it (ref count > 0). A full page also carries the chain hash of
its content, so a later prompt with the same prefix maps it instead of recomputing it. When its last user
lets go, a hashed page stays CACHED (content intact, reusable) until it is evicted, least recently used
first; a page without a hash goes straight back to FREE. Evicted cached pages and the pages of preempted
sequences move to a CPU tier when it has room. No torch here: the block manager plans copies, the model
runner performs them (see CopyPlan).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pagedchat.engine.cpu_tier import CpuTier, PoolCorrupted, require
from pagedchat.engine.records import PageState
from pagedchat.engine.sequence import Sequence

__all__ = ["BlockManager", "CopyPlan", "MemoryCounters", "Page", "PoolCorrupted"]


def page_hash(parent: int | None, tokens: list[int]) -> int:
    """Chain hash of a full page: its tokens and, through the parent's hash, every token before them.

    The model, dtype and block size are fixed for an engine, so tokens and position are all that decide a
    page's K/V here. Python's tuple hash of ints is deterministic across runs (no hash seed applies).
    """
    return hash((parent, tuple(tokens)))


def chain_hashes(tokens: list[int], block_size: int, num_pages: int, start: list[int] | None = None) -> list[int]:
    hashes = list(start or [])
    for i in range(len(hashes), num_pages):
        parent = hashes[-1] if hashes else None
        hashes.append(page_hash(parent, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass
class CopyPlan:
    """Page copies one step needs, run in this order before the forward pass."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # GPU page -> CPU page
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # CPU page -> GPU page
    cow: list[tuple[int, int]] = field(default_factory=list)       # GPU page -> GPU page (copy-on-write)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.cow)


@dataclass
class MemoryCounters:
    prefix_queries: int = 0     # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0        # of those, tokens served from cached pages
    evictions: int = 0          # cached pages dropped from the GPU pool
    offloads: int = 0           # cached pages saved to the CPU tier on eviction
    cpu_hits: int = 0           # cached pages a prefix hit copied back from the CPU tier
    swap_outs: int = 0          # sequences preempted by swapping to the CPU tier
    swap_ins: int = 0
    recomputes: int = 0         # sequences preempted by dropping their pages
    cow_copies: int = 0


@dataclass(eq=False, slots=True)
class Page:
    """One physical GPU page: who maps it and, once full, what it holds (as vLLM's KVCacheBlock)."""

    index: int
    ref: int = 0                          # block tables mapping it, plus a pin while it is a copy source
    hash: int | None = None               # chain hash of its content, while advertised for reuse
    parent: int | None = None             # the chain hash of the page before it
    tokens: tuple[int, ...] | None = None  # its tokens, for matches inside a page

    @property
    def state(self) -> PageState:
        if self.ref:
            return PageState.USED
        return PageState.FREE if self.hash is None else PageState.CACHED


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, num_cpu_pages: int = 0):
        self.num_pages = num_pages
        self.block_size = block_size
        self.pages = [Page(i) for i in range(num_pages)]
        self.cached: dict[int, int] = {}                   # hash -> GPU page holding that content
        # What a cached page holds, by the hash of the page before it, for matches inside a page.
        self.children: dict[int | None, set[int]] = {}
        self._pinned: list[int] = []                       # copy sources held until this step's copies ran
        self._fresh: set[int] = set()                      # published this step: written by its forward pass
        self.free: deque[int] = deque(range(num_pages))   # pages holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; least recently used first
        self.cpu = CpuTier(num_cpu_pages)
        self.counters = MemoryCounters()
        self.recent_lookups: deque[tuple[int, int]] = deque(maxlen=64)  # (queried, hit) per admission
        self._ops = CopyPlan()
        self._taken: list[CopyPlan] = []                   # this step's copies, until end_step

    # ---- page pool -------------------------------------------------------------------------------------
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_counts(self) -> dict[int, int]:
        """page -> reference count, pages in use only."""
        return {p.index: p.ref for p in self.pages if p.ref}

    def _take(self) -> int:
        """A page for new content: a free one, else the least recently used cached one."""
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            self._evict(page)
        self.pages[page].ref = 1
        return page

    def _publish(self, page: int, hashes: list[int], i: int, token_ids: list[int]) -> None:
        """Offer page (logical page i of a sequence with these chain hashes and tokens) for reuse: whole under
        its chain hash, or its first tokens to a prompt that continues the same parent (see _partial_match)."""
        record = self.pages[page]
        record.hash, record.parent = hashes[i], hashes[i - 1] if i else None
        record.tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
        self.cached[record.hash] = page
        self.children.setdefault(record.parent, set()).add(page)
        self._fresh.add(page)

    def _unpublish(self, page: int) -> int:
        record = self.pages[page]
        h = record.hash
        del self.cached[h]
        siblings = self.children[record.parent]
        siblings.discard(page)
        if not siblings:
            del self.children[record.parent]
        record.hash = record.parent = record.tokens = None
        return h

    def _forget(self, page: int) -> None:
        """Un-advertise a page; an unused one goes from the cached pool to the free one."""
        if self.pages[page].hash is None:
            return
        self._unpublish(page)
        if page in self.evictable:
            del self.evictable[page]
            self.free.append(page)

    def _evict(self, page: int) -> None:
        h = self._unpublish(page)
        self.counters.evictions += 1
        cpu_page = self.cpu.offload(h)
        if cpu_page is not None:
            self._ops.swap_out.append((page, cpu_page))
            self.counters.offloads += 1

    def _ref(self, page: int) -> None:
        record = self.pages[page]
        if record.ref == 0:
            self.evictable.pop(page)
        record.ref += 1

    def _unref(self, page: int) -> None:
        record = self.pages[page]
        record.ref -= 1
        if record.ref == 0:
            if record.hash is not None:
                self.evictable[page] = None  # most recently used end
            else:
                self.free.append(page)

    def pending_ops(self) -> CopyPlan:
        """The copies planned so far this step, without taking them."""
        return CopyPlan(list(self._ops.swap_out), list(self._ops.swap_in), list(self._ops.cow))

    def take_ops(self) -> CopyPlan:
        ops, self._ops = self._ops, CopyPlan()
        self._taken.append(ops)
        return ops

    def end_step(self) -> None:
        for page in self._pinned:
            self._unref(page)
        self._pinned.clear()
        self._fresh.clear()
        self._taken.clear()
        self.cpu.end_step()

    def abort_step(self, copies_ran: bool) -> tuple[set[int], set[int]]:
        """End a step whose forward pass did not complete. Pages published this step are no longer advertised
        (their K/V were never written); when the copies did not run, cached CPU pages they were to fill are
        dropped too. Returns the GPU and CPU pages of live sequences whose content is now undefined."""
        ops = [*self._taken, self.take_ops()]
        for page in list(self._fresh):
            self._forget(page)
        bad_gpu: set[int] = set()
        bad_cpu: set[int] = set()
        if not copies_ran:
            bad_gpu = {dst for plan in ops for _, dst in plan.swap_in + plan.cow}
            bad_cpu = {dst for plan in ops for _, dst in plan.swap_out}
            for cpu_page in bad_cpu:
                self.cpu.drop(cpu_page)
        self.end_step()
        return bad_gpu, bad_cpu

    def reconcile(self, gpu_tables: list[list[int]], cpu_tables: list[list[int]]) -> None:
        """After a fault that may have stopped an allocation halfway: set every ref count to the number of
        surviving block tables that map the page, and rebuild the pools around them (nothing mapped is lost;
        a page nobody maps is freed or kept cached)."""
        counts = [0] * self.num_pages
        for table in gpu_tables:
            for page in table:
                counts[page] += 1
        for record, count in zip(self.pages, counts):
            record.ref = count
        self.evictable = OrderedDict((p, None) for p in self.evictable if self.pages[p].state is PageState.CACHED)
        for record in self.pages:
            if record.state is PageState.CACHED and record.index not in self.evictable:
                self.evictable[record.index] = None
        self.free = deque(r.index for r in self.pages if r.state is PageState.FREE)
        self.cpu.reconcile({p for table in cpu_tables for p in table})

    # ---- sequences -------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, token_budget: int) -> int:
        """Map seq's cached prefix and take pages for its first chunk.

        Returns the number of tokens to compute this step, or 0 (and changes nothing) when there is no room.
        The last prompt token is always computed: its logits pick the first new token.
        """
        bs = self.block_size
        hashes = chain_hashes(seq.token_ids, bs, (len(seq.token_ids) - 1) // bs)
        gpu_hits, cpu_hits = [], []
        for h in hashes:
            cpu_page = self.cpu.lookup(h)
            if h in self.cached and not cpu_hits:
                gpu_hits.append(self.cached[h])
            elif cpu_page is not None and h not in self.cached:  # never advertise one hash on two GPU pages
                cpu_hits.append(cpu_page)
            else:
                break
        hit_pages = len(gpu_hits) + len(cpu_hits)
        hit_tokens = hit_pages * bs
        source, partial = self._partial_match(seq.token_ids, hashes[hit_pages - 1] if hit_pages else None,
                                              hit_tokens)
        start = hit_tokens + partial
        n = min(len(seq.token_ids) - start, token_budget)
        if n <= 0:
            return 0
        fresh = self.pages_for(start + n) - hit_pages
        pinned = gpu_hits + ([source] if partial else [])
        reclaimable = sum(1 for p in pinned if self.pages[p].ref == 0)
        if fresh + len(cpu_hits) > self.num_available() - reclaimable:
            return 0
        for page in pinned:  # pin the GPU hits first, so taking pages below cannot evict them
            self._ref(page)
        table = list(gpu_hits)
        for cpu_page in cpu_hits:  # before taking GPU pages: their offloads must not reuse a page read here
            self.cpu.release_cached(cpu_page)
        for cpu_page in cpu_hits:
            i = len(table)
            page = self._take()
            self._ops.swap_in.append((cpu_page, page))
            self.counters.cpu_hits += 1
            self._publish(page, hashes, i, seq.token_ids)
            table.append(page)
        seq.block_table = table
        seq.page_hashes = hashes[:hit_pages]
        seq.num_computed = start
        self._grow(seq, start + n)
        if partial:
            # The source keeps serving its own chain: copy it, and let this sequence write past the match.
            # It stays pinned until end_step, so nothing this step reuses it before the copy has run.
            self._pinned.append(source)
            self._ops.cow.append((source, seq.block_table[hit_pages]))
            self.counters.cow_copies += 1
        if not seq.prefix_counted:
            seq.prefix_counted = True
            seq.cached_tokens = start
            self.counters.prefix_queries += len(seq.token_ids)
            self.counters.prefix_hits += start
            self.recent_lookups.append((len(seq.token_ids), start))
        return n

    def _partial_match(self, tokens: list[int], parent: int | None, start: int) -> tuple[int | None, int]:
        """The cached page after `parent` whose first tokens best match tokens[start:], and how many match.

        Full pages are shared by hash; this finds the rest of a shared prefix inside the next page (a system
        prompt's last, partly filled page, say), leaving the last prompt token to be computed. Mapping a page
        is safe the step it is written (attention reads after every write), but copying one is not."""
        limit = min(self.block_size - 1, len(tokens) - 1 - start)
        best, best_n = None, 0
        for page in self.children.get(parent, ()) if limit > 0 else ():
            if page in self._fresh:  # its K/V are written by this step's forward pass, after copies run
                continue
            n = 0
            for a, b in zip(self.pages[page].tokens, tokens[start:start + limit]):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = page, n
        return best, best_n

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())

    def prepare_write(self, seq: Sequence, n: int) -> bool:
        """Make room for seq's next n tokens: new pages past its end, and a private copy of a shared page
        it is about to write into (copy-on-write). False, with nothing changed, when the pool is short."""
        offset = seq.num_computed % self.block_size
        idx = seq.num_computed // self.block_size
        shared_tail = offset != 0 and self.pages[seq.block_table[idx]].ref > 1
        needed = max(0, self.pages_for(seq.num_computed + n) - len(seq.block_table)) + shared_tail
        if needed > self.num_available():
            return False
        if shared_tail:
            old = seq.block_table[idx]
            new = self._take()
            self._ops.cow.append((old, new))
            self._unref(old)
            seq.block_table[idx] = new
            self.counters.cow_copies += 1
        self._grow(seq, seq.num_computed + n)
        return True

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the pages that will be full once seq's first num_tokens are computed, and offer them for reuse.

        A page whose content is already cached elsewhere stays private (a duplicate): merging would remap a
        live block table mid-flight, and such duplicates only live as long as their sequence runs.
        """
        full = num_tokens // self.block_size
        seq.page_hashes = chain_hashes(seq.token_ids, self.block_size, full, seq.page_hashes)
        pages = self.pages
        for i, h in enumerate(seq.page_hashes):
            page = seq.block_table[i]
            if pages[page].hash is None and h not in self.cached:
                self._publish(page, seq.page_hashes, i, seq.token_ids)

    def free_seq(self, seq: Sequence) -> None:
        """Let go of seq's pages. The end of the chain goes first, so it is also evicted first."""
        for page in reversed(seq.block_table):
            self._unref(page)
        seq.block_table = []
        for cpu_page in seq.cpu_table:
            self.cpu.release_held(cpu_page, after_step=False)
        seq.cpu_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child maps every page of the parent, partial last page included; writes copy first."""
        for page in parent.block_table:
            self.pages[page].ref += 1
        child.block_table = list(parent.block_table)
        child.page_hashes = list(parent.page_hashes)
        child.num_computed = parent.num_computed

    def fork_prefix(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """The child maps the parent's pages holding its first num_tokens tokens, as computed; a partial last
        page is shared too, and the child's next write into it copies it first."""
        pages = self.pages_for(num_tokens)
        for page in parent.block_table[:pages]:
            self.pages[page].ref += 1
        child.block_table = list(parent.block_table[:pages])
        child.page_hashes = list(parent.page_hashes[:num_tokens // self.block_size])
        child.num_computed = num_tokens

    # ---- preemption --------------------------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> bool:
        """Copy seq's pages to the CPU tier and release them on the GPU; False if the tier lacks room."""
        if len(seq.block_table) > self.cpu.available():
            return False
        for page in seq.block_table:
            cpu_page = self.cpu.hold()
            self._ops.swap_out.append((page, cpu_page))
            seq.cpu_table.append(cpu_page)
        for page in reversed(seq.block_table):
            self._unref(page)
        seq.block_table = []
        self.counters.swap_outs += 1
        return True

    def swap_in(self, seq: Sequence, next_tokens: int) -> bool:
        """Bring a swapped-out sequence back, with room for its next tokens. Full pages still cached on the
        GPU are mapped again rather than copied."""
        cached_page = [self.cached.get(seq.page_hashes[i]) if i < len(seq.page_hashes) else None
                       for i in range(len(seq.cpu_table))]
        reclaimable = sum(1 for p in cached_page if p is not None and self.pages[p].ref == 0)
        grow = max(0, self.pages_for(seq.num_computed + next_tokens) - len(seq.cpu_table))
        if cached_page.count(None) + grow > self.num_available() - reclaimable:
            return False
        for page in cached_page:
            if page is not None:
                self._ref(page)
        table = list(cached_page)
        for i, cpu_page in enumerate(seq.cpu_table):
            if table[i] is None:
                table[i] = self._take()
                self._ops.swap_in.append((cpu_page, table[i]))
            self.cpu.release_held(cpu_page, after_step=True)
        seq.block_table = table
        seq.cpu_table = []
        self._grow(seq, seq.num_computed + next_tokens)
        self.register_full_pages(seq, seq.num_computed)
        self.counters.swap_ins += 1
        return True

    # ---- views -------------------------------------------------------------------------------------------
    def page_states(self) -> list[PageState]:
        return [p.state for p in self.pages]

    def check_invariants(self, tables: list[list[int]], cpu_tables: list[list[int]] | None = None) -> None:
        """Each page's ref count equals the number of block tables mapping it; no page is free and mapped.
        With cpu_tables (the swapped-out sequences'), the CPU tier holds exactly their pages."""
        counts = [0] * self.num_pages
        for table in tables + [self._pinned]:  # a pinned copy source is referenced until end_step
            for page in table:
                counts[page] += 1
        require(counts == [p.ref for p in self.pages], "ref counts differ from block tables")
        mapped = {p for p in range(self.num_pages) if counts[p]}
        require(not mapped & set(self.free), "a mapped page is in the free pool")
        require(not mapped & set(self.evictable), "a mapped page is in the cached pool")
        require(len(self.free) + len(self.evictable) + len(mapped) == self.num_pages, "a page leaked")
        require(all(self.pages[p].state is PageState.CACHED for p in self.evictable), "an evictable page is not cached")
        require(all(self.pages[page].hash == h for h, page in self.cached.items()), "a cached page lost its hash")
        indexed = [p for pages in self.children.values() for p in pages]
        require(sorted(indexed) == sorted(self.cached.values()), "the index of page contents differs from the cache")
        self.cpu.check()
        if cpu_tables is not None:
            held = [p for table in cpu_tables for p in table]
            require(len(held) == len(set(held)) and set(held) == self.cpu.held_pages(), "CPU pages held differ")
