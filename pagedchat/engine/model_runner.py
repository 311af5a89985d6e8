"""Owns the KV cache tensors; turns a step plan into one forward pass and performs the plan's page copies."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from pagedchat.kernels import kv_pages
from pagedchat.model import hugepages
from pagedchat.model.attention import AttentionMetadata
from pagedchat.engine.pages import CopyPlan
from pagedchat.engine.pool_warmer import PoolWarmer
from pagedchat.engine.scheduler import StepPlan
from pagedchat.engine.records import NULL_PAGE
from pagedchat.engine.sequence import Sequence
from pagedchat.engine.sizing import GroupPlan
from pagedchat.model.decoder import DecoderModel


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU from the OS's lazily zeroed memory: pages are handed out as they are first
    touched, instead of torch writing the whole pool at start (docs/bench.md#quantized-weights-kept-packed
    times both). On Linux the pool asks for huge pages (model/hugepages.py): a step's attention then misses the TLB
    less, and a page's first write faults once per 2 MiB instead of once per 4 KiB
    (docs/bench.md#panels-packed-at-load)."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:  # an empty array has no bytes to view as another dtype
        return torch.zeros(shape, dtype=dtype, device=device)
    return hugepages.anonymous(nbytes).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: DecoderModel, groups: tuple[GroupPlan, ...], block_size: int,
                 kv_dtype: torch.dtype | None = None):
        """groups: each layer group's pool (engine/sizing.py); its KV pages live in a tensor of their own.
        kv_dtype: the pages' (kernels/kv_pages.py); None: the model's activations' dtype."""
        cfg = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_dtype = kv_dtype or model.dtype
        page = (block_size, cfg.num_kv_heads, kv_pages.row_width(cfg.head_dim, self.kv_dtype))
        # A window group's pool has one page more, its null page: never written, so all zeros, and what a
        # released entry (NULL_PAGE) points the kernels at. A kernel reads it only where the window masks it out
        # (the torch prefill path and the reference gather a chunk's pages from the first), and zeros keep the
        # masked products finite.
        self.null_pages = [g.num_pages if g.window is not None else None for g in groups]
        # Zeros, not empty: masked-out slots are still multiplied by a zero weight, and NaN * 0 is NaN.
        self.kv_caches = [zeros((len(g.layers), 2, g.num_pages + (g.window is not None), *page), self.kv_dtype,
                                self.device) for g in groups]
        self.warmers = [PoolWarmer(kv) for kv in self.kv_caches] if self.device.type == "cpu" else []
        self.cpu_caches = [self._host((len(g.layers), 2, g.num_cpu_pages, *page), self.kv_dtype) for g in groups]
        self.layer_groups = [0] * cfg.num_layers
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = [None] * cfg.num_layers  # type: ignore[list-item]
        for gi, (g, kv) in enumerate(zip(groups, self.kv_caches)):
            for j, layer in enumerate(g.layers):
                self.layer_groups[layer] = gi
                self.layer_kv[layer] = (kv[j, 0], kv[j, 1])

    def warm_some(self) -> bool:
        """One turn of what the engine's idle time is for: the weights' next huge pages, where they were read into
        small ones (model/hugepages.py's Collapser), then a region of the pool's next pages
        (engine/pool_warmer.py). False when none is left."""
        huge_pages = self.model.huge_pages
        if huge_pages is not None and huge_pages.collapse_some():
            return True
        return any(warmer.warm_some() for warmer in self.warmers)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The first group's pages (all of them, in a model without windows): [layers, 2, pages, block_size,
        kv_heads, head_dim]."""
        return self.kv_caches[0]

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned, for asynchronous copies to the GPU
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        return zeros(shape, dtype, torch.device("cpu"))

    def copy_pages(self, ops: tuple[CopyPlan, ...]) -> None:
        """Each group's copies. Swap-outs first: a page swapped out this step may be handed to another sequence
        in the same step."""
        for plan, kv_cache, cpu_cache in zip(ops, self.kv_caches, self.cpu_caches):
            if plan.swap_out:
                src, dst = self._index(plan.swap_out)
                cpu_cache[:, :, dst.cpu()] = kv_cache[:, :, src].to("cpu")
            if plan.swap_in:
                src, dst = self._index(plan.swap_in)
                kv_cache[:, :, dst] = cpu_cache[:, :, src.cpu()].to(self.device, non_blocking=True)
            if plan.cow:
                src, dst = self._index(plan.cow)
                kv_cache[:, :, dst] = kv_cache[:, :, src]

    def _index(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        return idx[:, 0], idx[:, 1]

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """One forward over every scheduled chunk; logits [sampled rows, vocab] in plan order (a draft's chunk
        samples each of its last 1 + k positions)."""
        if self.model.huge_pages is not None:  # an engine that is never idle gets them too, a huge page a step
            self.model.huge_pages.collapse_some(hugepages.HUGE_PAGE)
        ids, positions, rows = [], [], []
        for item in plan.scheduled:
            start = item.seq.num_computed
            ids.extend(item.token_ids)
            positions.extend(range(start, start + item.num_tokens))
            rows.extend(range(len(ids) - item.rows, len(ids)))
        units = _units(plan)
        dev = self.device
        query_start_loc = torch.tensor([0, *itertools.accumulate(u.queries for u in units)], dtype=torch.int32,
                                       device=dev)
        context_lens = torch.tensor([u.context_len for u in units], dtype=torch.int32, device=dev)
        metas = [self._group_meta(plan, units, group, null, query_start_loc, context_lens)
                 for group, null in enumerate(self.null_pages)]
        return self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.layer_kv, [metas[g] for g in self.layer_groups], torch.tensor(rows, dtype=torch.int64, device=dev))

    def _group_meta(self, plan: StepPlan, units: list[_Unit], group: int, null: int | None,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor) -> AttentionMetadata:
        """One group's slots and block tables (one per unit); the step's lengths are every group's."""
        bs = self.block_size
        slots, tables = [], {}
        for item in plan.scheduled:
            seq = item.seq
            table = seq.table(group).block_table
            new = range(seq.num_computed, seq.num_computed + item.num_tokens)
            slots.extend(table[p // bs] * bs + p % bs for p in new)
            tables[id(seq)] = table if null is None else [null if p == NULL_PAGE else p for p in table]
        if self.warmers and slots:
            self.warmers[group].written(max(slots) // bs)
        width = max(len(t) for t in tables.values())
        padded = [tables[id(u.seq)] + [0] * (width - len(tables[id(u.seq)])) for u in units]
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_lens=[u.queries for u in units],
            context_lens_host=[u.context_len for u in units],
            max_query_len=max(u.queries for u in units),
            max_context_len=max(u.context_len for u in units),
        )


@dataclass(frozen=True)
class _Unit:
    """What attention sees as one sequence: queries ending at context_len."""

    seq: Sequence
    queries: int
    context_len: int


def _units(plan: StepPlan) -> list[_Unit]:
    """A chunk is one unit, but a draft's chunk is a unit per position, each one query at its own length: a
    step of decodes and drafts is then a decode step, which runs each layer as one call (the fused decode
    layer), and each verified row gets the arithmetic of a decode at its position (same request, same tokens)."""
    units = []
    for item in plan.scheduled:
        seq, end = item.seq, item.seq.num_computed + item.num_tokens
        if item.draft:
            units.extend(_Unit(seq, 1, p + 1) for p in range(seq.num_computed, end))
        else:
            units.append(_Unit(seq, item.num_tokens, end))
    return units
