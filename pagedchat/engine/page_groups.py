"""The KV pages of a model whose layers keep them differently: one BlockManager per layer group, moved together.

Layers are grouped by sliding window (model/family.py, layer_groups): the global layers keep every page of a
sequence, and each window size's layers release the pages their window has passed. Each group has its own pool
of pages sized for its layers, and each sequence one table per group (as vLLM v1's KVCacheCoordinator keeps one
SingleTypeKVCacheManager per group). Every operation on a sequence happens in all groups or in none: each
group is asked whether it has room before any of them changes. A model without windows has one group, which
behaves exactly as a lone BlockManager. No torch here.
"""

from __future__ import annotations

from pagedchat.engine.admission import Admission, admit
from pagedchat.engine.block_manager import BlockManager
from pagedchat.engine.pages import CopyPlan, Damage, MemoryCounters
from pagedchat.engine.sequence import Sequence

__all__ = ["PageGroups"]


class PageGroups:
    def __init__(self, groups: tuple[BlockManager, ...], max_chunk: int = 512):
        """groups: one manager per layer group, the first one the global layers' where the model has any (its
        counters count the prefix cache and preemptions, and its tables are a sequence's block_table);
        max_chunk: the most tokens a sequence computes in one step (the scheduler's max_tokens_per_step)."""
        self.groups = groups
        self.max_chunk = max_chunk
        self.first = groups[0]
        self.block_size = self.first.block_size

    # What requests are sized against and what preemption counts: the first group's.
    @property
    def counters(self) -> MemoryCounters:
        return self.first.counters

    @property
    def num_pages(self) -> int:
        return self.first.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """The most pages a request of num_tokens holds at once in the first group: every one in a global group,
        in a window group those that its window and a prefill chunk reach. The first group is the one to size a
        request against: the global layers' where there are any, and else no group holds more."""
        need = self.first.pages_for(num_tokens)
        most = self.first.most_pages(self.max_chunk)
        return need if most is None else min(need, most)

    # ---- sequences -------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, token_budget: int) -> Admission:
        return admit(self.groups, seq, token_budget)

    def prepare_write(self, seq: Sequence, n: int) -> bool:
        """Room for seq's next n tokens in every group (window groups release what their window passed
        first), or False with no page taken."""
        for group in self.groups:
            group.release_outside_window(seq)
        if not all(group.can_write(seq, n) for group in self.groups):
            return False
        for group in self.groups:
            group.prepare_write(seq, n)
        return True

    def can_write(self, seq: Sequence, n: int, spare: int = 0) -> bool:
        """Whether every group has room for seq's next n tokens, and spare pages more, without preempting."""
        return all(group.can_write(seq, n, spare) for group in self.groups)

    def roll_back(self, seq: Sequence) -> None:
        """Every group gives back the pages past seq's computed tokens (rejected draft tokens')."""
        for group in self.groups:
            group.roll_back(seq)

    def register_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        for group in self.groups:
            group.register_full_pages(seq, num_tokens)

    def free_seq(self, seq: Sequence) -> None:
        for group in self.groups:
            group.free_seq(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def fork_prefix(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        for group in self.groups:
            group.fork_prefix(parent, child, num_tokens)

    def swap_out(self, seq: Sequence) -> bool:
        """seq's pages to the CPU tier in every group (what its windows passed is released, not copied), or
        False with nothing copied."""
        for group in self.groups:
            group.release_outside_window(seq)
        if not all(group.can_swap_out(seq) for group in self.groups):
            return False
        for group in self.groups:
            group.swap_out(seq)
        return True

    def swap_in(self, seq: Sequence, next_tokens: int) -> bool:
        if not all(group.can_swap_in(seq, next_tokens) for group in self.groups):
            return False
        for group in self.groups:
            group.swap_in(seq, next_tokens)
        return True

    # ---- steps -------------------------------------------------------------------------------------------
    def take_ops(self) -> tuple[CopyPlan, ...]:
        """This step's page copies, one plan per group."""
        return tuple(group.take_ops() for group in self.groups)

    def end_step(self) -> None:
        for group in self.groups:
            group.end_step()

    def abort_step(self, copies_ran: bool) -> list[Damage]:
        return [group.abort_step(copies_ran) for group in self.groups]

    def repair(self, survivors: list[Sequence]) -> None:
        """After a fault: make every group's pool agree with the surviving sequences, then check it does."""
        for group in self.groups:
            tables = [s.table(group.group) for s in survivors]
            group.reconcile([t.block_table for t in tables], [t.cpu_table for t in tables])
        self.check_invariants(survivors)

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """BlockManager.check_invariants in every group, over these sequences' tables of it."""
        for group in self.groups:
            tables = [s.table(group.group) for s in seqs]
            group.check_invariants([t.block_table for t in tables], [t.cpu_table for t in tables])

    # ---- views -------------------------------------------------------------------------------------------
    def pages_used(self) -> list[int]:
        """Pages in use per group (mapped, or pinned for a copy)."""
        return [group.num_pages - group.pool.num_available() for group in self.groups]
