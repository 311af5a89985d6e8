"""Owns the KV cache tensors; turns a step plan into one forward pass and performs the plan's page copies."""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedchat.attention import AttentionMetadata
from pagedchat.engine.block_manager import CopyPlan
from pagedchat.engine.scheduler import StepPlan
from pagedchat.model.llama import DecoderModel


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU from calloc'd memory (numpy's zeros): the OS hands out zero pages as they are
    first touched, instead of torch writing the whole pool at start (docs/bench.md, "Quantized weights kept
    packed", times both)."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:  # an empty array has no bytes to view as another dtype
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: DecoderModel, num_pages: int, num_cpu_pages: int, block_size: int):
        cfg = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        page = (block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: masked-out slots are still multiplied by a zero weight, and NaN * 0 is NaN.
        self.kv_cache = zeros((cfg.num_layers, 2, num_pages, *page), model.dtype, self.device)
        shape = (cfg.num_layers, 2, num_cpu_pages, *page)
        if self.device.type == "cuda":  # pinned, for asynchronous copies to the GPU
            self.cpu_cache = torch.zeros(shape, dtype=model.dtype, pin_memory=True)
        else:
            self.cpu_cache = zeros(shape, model.dtype, torch.device("cpu"))

    def copy_pages(self, ops: CopyPlan) -> None:
        """Swap-outs first: a page swapped out this step may be handed to another sequence in the same step."""
        if ops.swap_out:
            src, dst = self._index(ops.swap_out)
            self.cpu_cache[:, :, dst.cpu()] = self.kv_cache[:, :, src].to("cpu")
        if ops.swap_in:
            src, dst = self._index(ops.swap_in)
            self.kv_cache[:, :, dst] = self.cpu_cache[:, :, src.cpu()].to(self.device, non_blocking=True)
        if ops.cow:
            src, dst = self._index(ops.cow)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _index(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        return idx[:, 0], idx[:, 1]

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """One forward over every scheduled chunk; logits [n_sampling, vocab] in plan order."""
        bs = self.block_size
        ids, positions, slots, qstart, ctx_lens, tables, rows = [], [], [], [0], [], [], []
        for item in plan.scheduled:
            seq, n = item.seq, item.num_tokens
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qstart.append(qstart[-1] + n)
            ctx_lens.append(end)
            tables.append(table)
            if item.samples:
                rows.append(qstart[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qstart, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_lens=[item.num_tokens for item in plan.scheduled],
            context_lens_host=ctx_lens,
            max_query_len=max(item.num_tokens for item in plan.scheduled),
            max_context_len=max(ctx_lens),
        )
        return self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_cache, meta, torch.tensor(rows, dtype=torch.int64, device=dev))
