"""One layer group's per-request planning over its page pool, prefix cache and CPU tier.

The parts (vLLM v1's BlockPool, its cached-block index, and its KVCacheManager, in that order):
- engine/page_pool.py, PagePool: the GPU pages, their ref counts, the free list and the eviction order;
- engine/prefix_cache.py, PrefixCache: which pages hold reusable content (chain hashes, matches inside a page);
- engine/cpu_tier.py, CpuTier: host pages that evicted cached pages and swapped-out sequences go to;
- this module, BlockManager: what a sequence's block table maps (a block is a sequence's logical run of
  block_size tokens, a page the physical slot holding it): admission's mapping, growth and copy-on-write, forks,
  swaps, a window group's release of passed pages, and repair after a fault. It moves no data: it plans the
  copies (CopyPlan) that the model runner performs. No torch here.

One BlockManager serves one layer group (engine/page_groups.py) and reads that group's table of each sequence.
A sliding-window group also releases the pages that every later query's window has passed: their entries
become NULL_PAGE, always a leading run of the table, since a window only moves forward.

Invariants kept here (the parts state and check their own): a page pinned as a copy source holds one reference
until end_step; a swapped-out sequence's CPU table holds exactly the CPU pages the tier has as held.
"""

from __future__ import annotations

from pagedchat.engine.admission import Admission, Match, admit
from pagedchat.engine.checks import require
from pagedchat.engine.cpu_tier import CpuTier
from pagedchat.engine.page_pool import PagePool
from pagedchat.engine.pages import CopyPlan, Damage, MemoryCounters, chain_hashes, mapped
from pagedchat.engine.prefix_cache import PrefixCache
from pagedchat.engine.records import NULL_PAGE
from pagedchat.engine.sequence import PageTable, Sequence


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, num_cpu_pages: int = 0, *, group: int = 0,
                 window: int | None = None):
        """group: which of a sequence's tables this manager keeps; window: the group's sliding window in tokens,
        whose passed pages it releases (None: a global group, which keeps every page)."""
        self.num_pages = num_pages
        self.block_size = block_size
        self.group = group
        self.window = window
        self.pool = PagePool(num_pages)
        self.cpu = CpuTier(num_cpu_pages)
        self.prefix = PrefixCache(self.pool, block_size, self.cpu)
        self.counters = MemoryCounters()
        self._pinned: list[int] = []                       # copy sources held until this step's copies ran
        self._ops = CopyPlan()
        self._taken: list[CopyPlan] = []                   # this step's copies, until end_step

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        """A page for new content (page_pool.py picks it); an evicted cached one is unpublished and, where the
        CPU tier has room, offloaded there before this step reuses it."""
        page, evicted = self.pool.take()
        if evicted:
            h = self.prefix.unpublish(page)
            self.counters.evictions += 1
            cpu_page = self.cpu.offload(h)
            if cpu_page is not None:
                self._ops.swap_out.append((page, cpu_page))
                self.counters.offloads += 1
        return page

    def _forget(self, page: int) -> None:
        """Un-advertise a page; an unused one goes from the cached pool to the free one."""
        if self.pool.pages[page].hash is None:
            return
        self.prefix.unpublish(page)
        self.pool.unadvertised(page)

    def take_ops(self) -> CopyPlan:
        ops, self._ops = self._ops, CopyPlan()
        self._taken.append(ops)
        return ops

    def end_step(self) -> None:
        for page in self._pinned:
            self.pool.unref(page)
        self._pinned.clear()
        self.prefix.end_step()
        self._taken.clear()
        self.cpu.end_step()

    def abort_step(self, copies_ran: bool) -> Damage:
        """End a step whose forward pass did not complete. Pages published this step are no longer advertised
        (their K/V were never written); when the copies did not run, cached CPU pages they were to fill are
        dropped too. Returns the GPU and CPU pages of live sequences whose content is now undefined."""
        ops = [*self._taken, self.take_ops()]
        for page in list(self.prefix.fresh):
            self._forget(page)
        bad_gpu: set[int] = set()
        bad_cpu: set[int] = set()
        if not copies_ran:
            bad_gpu = {dst for plan in ops for _, dst in plan.swap_in + plan.cow}
            bad_cpu = {dst for plan in ops for _, dst in plan.swap_out}
            for cpu_page in bad_cpu:
                self.cpu.drop(cpu_page)
        self.end_step()
        return Damage(self.group, frozenset(bad_gpu), frozenset(bad_cpu))

    def _counts(self, tables: list[list[int]]) -> list[int]:
        counts = [0] * self.num_pages
        for table in tables:
            for page in mapped(table):
                counts[page] += 1
        return counts

    def reconcile(self, gpu_tables: list[list[int]], cpu_tables: list[list[int]]) -> None:
        """After a fault that may have stopped an allocation halfway: set every ref count to the number of
        surviving block tables that map the page, and rebuild the pools around them (nothing mapped is lost;
        a page nobody maps is freed or kept cached)."""
        self.pool.reconcile(self._counts(gpu_tables))
        self.cpu.reconcile({p for table in cpu_tables for p in mapped(table)})

    # ---- sequences -------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, token_budget: int) -> Admission:
        """Map seq's cached prefix and take pages for its first chunk: engine/admission.py's admit, with this
        group alone."""
        return admit((self,), seq, token_budget)

    def _table(self, seq: Sequence) -> PageTable:
        return seq.table(self.group)

    def first_needed(self, num_tokens: int) -> int:
        """The first page that a query at position num_tokens or later can read: 0 in a global group."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size

    def most_pages(self, chunk: int) -> int | None:
        """The most pages one sequence maps at once in a window group computing chunks of up to `chunk` tokens:
        those its window reaches, the chunk's, the page the window straddles, and a copy source pinned for an
        admission that matches inside a page. None in a global group: a sequence keeps all its pages there."""
        return None if self.window is None else self.pages_for(self.window + chunk) + 2

    def match(self, hashes: list[int], pages: int) -> Match | None:
        """The cached pages an admission starting at page `pages` maps: those from the first page its window
        reaches (every one, in a global group), or None when one is missing."""
        skip = self.first_needed(pages * self.block_size)
        gpu, cpu = self.prefix.run(hashes, skip, pages)
        return Match(skip, tuple(gpu), tuple(cpu)) if skip + len(gpu) + len(cpu) == pages else None

    def longest_match(self, hashes: list[int], limit: int) -> int:
        """The most pages, at most limit, that match() serves. A global group serves any run from the first
        page; a window group needs the pages in reach of the match point, each length its own."""
        if self.window is None:
            return sum(map(len, self.prefix.run(hashes, 0, limit)))
        return next(n for n in range(limit, -1, -1) if self.match(hashes, n) is not None)

    def partial_match(self, tokens: list[int], hashes: list[int], match: Match) -> Match:
        """match, with the cached page after it whose first tokens best match the rest of the prompt.

        Full pages are shared by hash; this finds the rest of a shared prefix inside the next page (a system
        prompt's last, partly filled page, say), leaving the last prompt token to be computed."""
        start = match.pages * self.block_size
        parent = hashes[match.pages - 1] if match.pages else None
        limit = min(self.block_size - 1, len(tokens) - 1 - start)
        best, best_n = self.prefix.partial(parent, tokens[start:start + limit] if limit > 0 else [])
        return Match(match.skip, match.gpu, match.cpu, best, best_n, best is None or self.prefix.written(best))

    def fits(self, match: Match, num_tokens: int) -> bool:
        """Whether the pool has the pages that mapping match and growing to num_tokens take."""
        pinned = [*match.gpu, *([match.source] if match.partial else [])]
        reclaimable = sum(1 for p in pinned if self.pool.pages[p].ref == 0)
        fresh = self.pages_for(num_tokens) - match.pages
        return fresh + len(match.cpu) <= self.pool.num_available() - reclaimable

    def map_match(self, seq: Sequence, hashes: list[int], match: Match, num_tokens: int) -> None:
        """Map match into seq's table (fits() said there is room) and grow it to num_tokens."""
        for page in [*match.gpu, *([match.source] if match.partial else [])]:
            self.pool.ref(page)  # pin the GPU hits first, so taking pages below cannot evict them
        table = [NULL_PAGE] * match.skip + list(match.gpu)
        for cpu_page in match.cpu:  # before taking GPU pages: their offloads must not reuse a page read here
            self.cpu.release_cached(cpu_page)
        for cpu_page in match.cpu:
            i = len(table)
            page = self._take()
            self._ops.swap_in.append((cpu_page, page))
            self.counters.cpu_hits += 1
            self.prefix.publish(page, hashes, i, seq.token_ids)
            table.append(page)
        own = self._table(seq)
        own.block_table = table
        own.page_hashes = hashes[:match.pages]
        self._grow(seq, num_tokens)
        if match.partial:
            # The source keeps serving its own chain: copy it, and let this sequence write past the match.
            # It stays pinned until end_step, so nothing this step reuses it before the copy has run.
            self._pinned.append(match.source)
            self._ops.cow.append((match.source, table[match.pages]))
            self.counters.cow_copies += 1

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        table = self._table(seq).block_table
        while len(table) * self.block_size < num_tokens:
            table.append(self._take())

    def release_outside_window(self, seq: Sequence) -> None:
        """Unmap seq's pages that lie wholly before the window of its next token: no query from here on reads
        them (a fork's child starts no earlier than its parent's next token). A hashed one stays cached."""
        table = self._table(seq).block_table
        for i in reversed(range(min(self.first_needed(seq.num_computed), len(table)))):
            if table[i] == NULL_PAGE:
                break  # the rest of the leading run was released before
            self.pool.unref(table[i])
            table[i] = NULL_PAGE
            self.counters.window_released += 1

    def _write_needs(self, seq: Sequence, n: int) -> tuple[int, bool]:
        """(new pages past seq's end, whether the page it writes first is shared) for its next n tokens."""
        table = self._table(seq).block_table
        offset = seq.num_computed % self.block_size
        idx = seq.num_computed // self.block_size
        shared_tail = offset != 0 and self.pool.pages[table[idx]].ref > 1
        return max(0, self.pages_for(seq.num_computed + n) - len(table)), shared_tail

    def can_write(self, seq: Sequence, n: int, spare: int = 0) -> bool:
        """Whether the pool has the pages seq's next n tokens take, and spare pages more."""
        grow, shared_tail = self._write_needs(seq, n)
        return grow + shared_tail + spare <= self.pool.num_available()

    def prepare_write(self, seq: Sequence, n: int) -> bool:
        """Make room for seq's next n tokens: new pages past its end, and a private copy of a shared page
        it is about to write into (copy-on-write). False, with nothing changed, when the pool is short."""
        self.release_outside_window(seq)
        if not self.can_write(seq, n):
            return False
        if self._write_needs(seq, n)[1]:  # the page it writes first is shared: copy it
            table = self._table(seq).block_table
            idx = seq.num_computed // self.block_size
            old = table[idx]
            new = self._take()
            self._ops.cow.append((old, new))
            self.pool.unref(old)
            table[idx] = new
            self.counters.cow_copies += 1
        self._grow(seq, seq.num_computed + n)
        return True

    def roll_back(self, seq: Sequence) -> None:
        """Give back the pages past seq's computed tokens: taken for draft tokens that were rejected. They were
        grown this step (prepare_write copies a shared page before a write), so seq alone maps them and none is
        hashed: each returns to the free list. Slots of rejected tokens in the last kept page are written over
        by the next tokens, and no hash covers them before."""
        table = self._table(seq).block_table
        keep = self.pages_for(seq.num_computed)
        for page in reversed(table[keep:]):
            self.pool.unref(page)
            self.counters.rolled_back += 1
        del table[keep:]

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the pages that will be full once seq's first num_tokens are computed, and offer them for reuse.

        A page whose content is already cached elsewhere stays private (a duplicate): merging would remap a
        live block table mid-flight, and such duplicates only live as long as their sequence runs.
        """
        own = self._table(seq)
        full = num_tokens // self.block_size
        own.page_hashes = chain_hashes(seq.token_ids, self.block_size, full, own.page_hashes)
        pages = self.pool.pages
        for i, h in enumerate(own.page_hashes):
            page = own.block_table[i]
            if page != NULL_PAGE and pages[page].hash is None and self.prefix.page_of(h) is None:
                self.prefix.publish(page, own.page_hashes, i, seq.token_ids)

    def free_seq(self, seq: Sequence) -> None:
        """Let go of seq's pages, and of its hashes of them (one preempted for recompute is admitted anew). The
        end of the chain goes first, so it is also evicted first."""
        own = self._table(seq)
        own.page_hashes = []
        for page in reversed(mapped(own.block_table)):
            self.pool.unref(page)
        own.block_table = []
        for cpu_page in mapped(own.cpu_table):
            self.cpu.release_held(cpu_page, after_step=False)
        own.cpu_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child maps every page of the parent, partial last page included; writes copy first."""
        self._share(parent, child, len(self._table(parent).block_table), parent.num_computed)

    def fork_prefix(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """The child maps the parent's pages holding its first num_tokens tokens, as computed; a partial last
        page is shared too, and the child's next write into it copies it first."""
        self._share(parent, child, self.pages_for(num_tokens), num_tokens)

    def _share(self, parent: Sequence, child: Sequence, pages: int, num_tokens: int) -> None:
        """The core sets the child's num_computed first: a window group releases what lies before it."""
        require(child.num_computed == num_tokens, "a forked sequence's computed count was not set first")
        src, own = self._table(parent), self._table(child)
        own.block_table = list(src.block_table[:pages])
        for page in mapped(own.block_table):
            self.pool.ref(page)
        own.page_hashes = list(src.page_hashes[:num_tokens // self.block_size])
        self.release_outside_window(child)

    # ---- preemption --------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(mapped(self._table(seq).block_table)) <= self.cpu.available()

    def swap_out(self, seq: Sequence) -> bool:
        """Copy seq's pages to the CPU tier and release them on the GPU; False if the tier lacks room. Pages its
        window has passed are released first, not copied."""
        self.release_outside_window(seq)
        if not self.can_swap_out(seq):
            return False
        own = self._table(seq)
        for page in own.block_table:
            cpu_page = NULL_PAGE if page == NULL_PAGE else self.cpu.hold()
            if page != NULL_PAGE:
                self._ops.swap_out.append((page, cpu_page))
            own.cpu_table.append(cpu_page)
        for page in reversed(mapped(own.block_table)):
            self.pool.unref(page)
        own.block_table = []
        self.counters.swap_outs += 1
        return True

    def _swap_in_plan(self, seq: Sequence) -> list[int | None]:
        """Per entry of seq's CPU table: the GPU page still caching its content, NULL_PAGE, or None (copy)."""
        own = self._table(seq)
        return [NULL_PAGE if cpu_page == NULL_PAGE else
                self.prefix.page_of(own.page_hashes[i]) if i < len(own.page_hashes) else None
                for i, cpu_page in enumerate(own.cpu_table)]

    def can_swap_in(self, seq: Sequence, next_tokens: int) -> bool:
        plan = self._swap_in_plan(seq)
        reclaimable = sum(1 for p in plan if p not in (None, NULL_PAGE) and self.pool.pages[p].ref == 0)
        grow = max(0, self.pages_for(seq.num_computed + next_tokens) - len(plan))
        return plan.count(None) + grow <= self.pool.num_available() - reclaimable

    def swap_in(self, seq: Sequence, next_tokens: int) -> bool:
        """Bring a swapped-out sequence back, with room for its next tokens. Full pages still cached on the
        GPU are mapped again rather than copied."""
        if not self.can_swap_in(seq, next_tokens):
            return False
        own = self._table(seq)
        table = self._swap_in_plan(seq)
        for page in table:
            if page not in (None, NULL_PAGE):
                self.pool.ref(page)
        for i, cpu_page in enumerate(own.cpu_table):
            if table[i] is None:
                table[i] = self._take()
                self._ops.swap_in.append((cpu_page, table[i]))
            if cpu_page != NULL_PAGE:
                self.cpu.release_held(cpu_page, after_step=True)
        own.block_table = table
        own.cpu_table = []
        self._grow(seq, seq.num_computed + next_tokens)
        self.register_full_pages(seq, seq.num_computed)
        self.counters.swap_ins += 1
        return True

    # ---- invariants --------------------------------------------------------------------------------------
    def check_invariants(self, tables: list[list[int]], cpu_tables: list[list[int]] | None = None) -> None:
        """Each part's invariants, given these block tables; with cpu_tables (the swapped-out sequences'), the
        CPU tier holds exactly their pages."""
        self.pool.check(self._counts(tables + [self._pinned]))  # a pinned copy source is referenced until end_step
        self.prefix.check()
        self.cpu.check()
        if cpu_tables is not None:
            held = [p for table in cpu_tables for p in mapped(table)]
            require(len(held) == len(set(held)) and set(held) == self.cpu.held_pages(), "CPU pages held differ")
