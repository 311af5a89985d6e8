"""Physical KV pages: who maps them, what they hold, and where they live.

A page is USED while some block table maps it (ref count > 0). A full page also carries the chain hash of
its content, so a later prompt with the same prefix maps it instead of recomputing it. When its last user
lets go, a hashed page stays CACHED (content intact, reusable) until it is evicted, least recently used
first; a page without a hash goes straight back to FREE. Evicted cached pages and the pages of preempted
sequences move to a CPU tier when it has room. No torch here: the block manager plans copies, the model
runner performs them (see CopyPlan).

One BlockManager serves one layer group (engine/page_groups.py) and reads that group's table of each sequence.
A sliding-window group also releases the pages that every later query's window has passed: their entries
become NULL_PAGE, always a leading run of the table, since a window only moves forward.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pagedchat.engine.admission import Match, admit
from pagedchat.engine.cpu_tier import CpuTier, PoolCorrupted, require
from pagedchat.engine.pages import CopyPlan, Damage, MemoryCounters, Page, chain_hashes, mapped
from pagedchat.engine.records import PageState
from pagedchat.engine.sequence import NULL_PAGE, PageTable, Sequence

__all__ = ["BlockManager", "CopyPlan", "Damage", "MemoryCounters", "Page", "PoolCorrupted", "chain_hashes"]


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, num_cpu_pages: int = 0, *, group: int = 0,
                 window: int | None = None):
        """group: which of a sequence's tables this manager keeps; window: the group's sliding window in tokens,
        whose passed pages it releases (None: a global group, which keeps every page)."""
        self.num_pages = num_pages
        self.block_size = block_size
        self.group = group
        self.window = window
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

    def abort_step(self, copies_ran: bool) -> Damage:
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
        return Damage(self.group, frozenset(bad_gpu), frozenset(bad_cpu))

    def reconcile(self, gpu_tables: list[list[int]], cpu_tables: list[list[int]]) -> None:
        """After a fault that may have stopped an allocation halfway: set every ref count to the number of
        surviving block tables that map the page, and rebuild the pools around them (nothing mapped is lost;
        a page nobody maps is freed or kept cached)."""
        counts = [0] * self.num_pages
        for table in gpu_tables:
            for page in mapped(table):
                counts[page] += 1
        for record, count in zip(self.pages, counts):
            record.ref = count
        self.evictable = OrderedDict((p, None) for p in self.evictable if self.pages[p].state is PageState.CACHED)
        for record in self.pages:
            if record.state is PageState.CACHED and record.index not in self.evictable:
                self.evictable[record.index] = None
        self.free = deque(r.index for r in self.pages if r.state is PageState.FREE)
        self.cpu.reconcile({p for table in cpu_tables for p in mapped(table)})

    # ---- sequences -------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, token_budget: int) -> int:
        """Map seq's cached prefix and take pages for its first chunk: engine/admission.py's admit, with this
        group alone. Returns the tokens to compute this step, or 0 (and changes nothing) without room."""
        return admit((self,), seq, token_budget)

    def _table(self, seq: Sequence) -> PageTable:
        return seq.table(self.group)

    def first_needed(self, num_tokens: int) -> int:
        """The first page that a query at position num_tokens or later can read: 0 in a global group."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size

    def _run(self, hashes: list[int], skip: int, limit: int) -> tuple[list[int], list[int]]:
        """The cached pages of hashes[skip:limit] in a run from skip: GPU ones, then CPU ones (one hash is never
        advertised on two GPU pages), up to the first page cached nowhere."""
        gpu, cpu = [], []
        for h in hashes[skip:limit]:
            cpu_page = self.cpu.lookup(h)
            if h in self.cached and not cpu:
                gpu.append(self.cached[h])
            elif cpu_page is not None and h not in self.cached:
                cpu.append(cpu_page)
            else:
                break
        return gpu, cpu

    def most_pages(self, chunk: int) -> int | None:
        """The most pages one sequence maps at once in a window group computing chunks of up to `chunk` tokens:
        those its window reaches, the chunk's, the page the window straddles, and a copy source pinned for an
        admission that matches inside a page. None in a global group: a sequence keeps all its pages there."""
        return None if self.window is None else self.pages_for(self.window + chunk) + 2

    def match(self, hashes: list[int], pages: int) -> Match | None:
        """The cached pages an admission starting at page `pages` maps: those from the first page its window
        reaches (every one, in a global group), or None when one is missing."""
        skip = self.first_needed(pages * self.block_size)
        gpu, cpu = self._run(hashes, skip, pages)
        return Match(skip, tuple(gpu), tuple(cpu)) if skip + len(gpu) + len(cpu) == pages else None

    def longest_match(self, hashes: list[int], limit: int) -> int:
        """The most pages, at most limit, that match() serves. A global group serves any run from the first
        page; a window group needs the pages in reach of the match point, each length its own."""
        if self.window is None:
            return sum(map(len, self._run(hashes, 0, limit)))
        return next(n for n in range(limit, -1, -1) if self.match(hashes, n) is not None)

    def partial_match(self, tokens: list[int], hashes: list[int], match: Match) -> Match:
        """match, with the cached page after it whose first tokens best match the rest of the prompt.

        Full pages are shared by hash; this finds the rest of a shared prefix inside the next page (a system
        prompt's last, partly filled page, say), leaving the last prompt token to be computed. Mapping a page
        is safe the step it is written (attention reads after every write), but copying one is not."""
        start = match.pages * self.block_size
        parent = hashes[match.pages - 1] if match.pages else None
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
        return Match(match.skip, match.gpu, match.cpu, best, best_n)

    def fits(self, match: Match, num_tokens: int) -> bool:
        """Whether the pool has the pages that mapping match and growing to num_tokens take."""
        pinned = [*match.gpu, *([match.source] if match.partial else [])]
        reclaimable = sum(1 for p in pinned if self.pages[p].ref == 0)
        fresh = self.pages_for(num_tokens) - match.pages
        return fresh + len(match.cpu) <= self.num_available() - reclaimable

    def map_match(self, seq: Sequence, hashes: list[int], match: Match, num_tokens: int) -> None:
        """Map match into seq's table (fits() said there is room) and grow it to num_tokens."""
        for page in [*match.gpu, *([match.source] if match.partial else [])]:
            self._ref(page)  # pin the GPU hits first, so taking pages below cannot evict them
        table = [NULL_PAGE] * match.skip + list(match.gpu)
        for cpu_page in match.cpu:  # before taking GPU pages: their offloads must not reuse a page read here
            self.cpu.release_cached(cpu_page)
        for cpu_page in match.cpu:
            i = len(table)
            page = self._take()
            self._ops.swap_in.append((cpu_page, page))
            self.counters.cpu_hits += 1
            self._publish(page, hashes, i, seq.token_ids)
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
            self._unref(table[i])
            table[i] = NULL_PAGE
            self.counters.window_released += 1

    def _write_needs(self, seq: Sequence, n: int) -> tuple[int, bool]:
        """(new pages past seq's end, whether the page it writes first is shared) for its next n tokens."""
        table = self._table(seq).block_table
        offset = seq.num_computed % self.block_size
        idx = seq.num_computed // self.block_size
        shared_tail = offset != 0 and self.pages[table[idx]].ref > 1
        return max(0, self.pages_for(seq.num_computed + n) - len(table)), shared_tail

    def can_write(self, seq: Sequence, n: int) -> bool:
        grow, shared_tail = self._write_needs(seq, n)
        return grow + shared_tail <= self.num_available()

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
            self._unref(old)
            table[idx] = new
            self.counters.cow_copies += 1
        self._grow(seq, seq.num_computed + n)
        return True

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the pages that will be full once seq's first num_tokens are computed, and offer them for reuse.

        A page whose content is already cached elsewhere stays private (a duplicate): merging would remap a
        live block table mid-flight, and such duplicates only live as long as their sequence runs.
        """
        own = self._table(seq)
        full = num_tokens // self.block_size
        own.page_hashes = chain_hashes(seq.token_ids, self.block_size, full, own.page_hashes)
        pages = self.pages
        for i, h in enumerate(own.page_hashes):
            page = own.block_table[i]
            if page != NULL_PAGE and pages[page].hash is None and h not in self.cached:
                self._publish(page, own.page_hashes, i, seq.token_ids)

    def free_seq(self, seq: Sequence) -> None:
        """Let go of seq's pages. The end of the chain goes first, so it is also evicted first."""
        own = self._table(seq)
        for page in reversed(mapped(own.block_table)):
            self._unref(page)
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
        src, own = self._table(parent), self._table(child)
        own.block_table = list(src.block_table[:pages])
        for page in mapped(own.block_table):
            self.pages[page].ref += 1
        own.page_hashes = list(src.page_hashes[:num_tokens // self.block_size])
        child.num_computed = num_tokens
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
            self._unref(page)
        own.block_table = []
        self.counters.swap_outs += 1
        return True

    def _swap_in_plan(self, seq: Sequence) -> list[int | None]:
        """Per entry of seq's CPU table: the GPU page still caching its content, NULL_PAGE, or None (copy)."""
        own = self._table(seq)
        return [NULL_PAGE if cpu_page == NULL_PAGE else
                self.cached.get(own.page_hashes[i]) if i < len(own.page_hashes) else None
                for i, cpu_page in enumerate(own.cpu_table)]

    def can_swap_in(self, seq: Sequence, next_tokens: int) -> bool:
        plan = self._swap_in_plan(seq)
        reclaimable = sum(1 for p in plan if p not in (None, NULL_PAGE) and self.pages[p].ref == 0)
        grow = max(0, self.pages_for(seq.num_computed + next_tokens) - len(plan))
        return plan.count(None) + grow <= self.num_available() - reclaimable

    def swap_in(self, seq: Sequence, next_tokens: int) -> bool:
        """Bring a swapped-out sequence back, with room for its next tokens. Full pages still cached on the
        GPU are mapped again rather than copied."""
        if not self.can_swap_in(seq, next_tokens):
            return False
        own = self._table(seq)
        table = self._swap_in_plan(seq)
        for page in table:
            if page not in (None, NULL_PAGE):
                self._ref(page)
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

    # ---- views -------------------------------------------------------------------------------------------
    def page_states(self) -> list[PageState]:
        return [p.state for p in self.pages]

    def check_invariants(self, tables: list[list[int]], cpu_tables: list[list[int]] | None = None) -> None:
        """Each page's ref count equals the number of block tables mapping it; no page is free and mapped.
        With cpu_tables (the swapped-out sequences'), the CPU tier holds exactly their pages."""
        counts = [0] * self.num_pages
        for table in tables + [self._pinned]:  # a pinned copy source is referenced until end_step
            for page in mapped(table):
                counts[page] += 1
        require(counts == [p.ref for p in self.pages], "ref counts differ from block tables")
        in_use = {p for p in range(self.num_pages) if counts[p]}
        require(not in_use & set(self.free), "a mapped page is in the free pool")
        require(not in_use & set(self.evictable), "a mapped page is in the cached pool")
        require(len(self.free) + len(self.evictable) + len(in_use) == self.num_pages, "a page leaked")
        require(all(self.pages[p].state is PageState.CACHED for p in self.evictable), "an evictable page is not cached")
        require(all(self.pages[page].hash == h for h, page in self.cached.items()), "a cached page lost its hash")
        indexed = [p for pages in self.children.values() for p in pages]
        require(sorted(indexed) == sorted(self.cached.values()), "the index of page contents differs from the cache")
        self.cpu.check()
        if cpu_tables is not None:
            held = [p for table in cpu_tables for p in mapped(table)]
            require(len(held) == len(set(held)) and set(held) == self.cpu.held_pages(), "CPU pages held differ")
