"""The decoder every registered family runs (pagedchat/model/families/), over a flat token batch and a paged
KV cache.

Tokens of all scheduled sequences are packed into one [T, hidden] batch with no padding; positions say where
each sits in its own sequence, and the attention metadata says which pages hold its context. A family's
recipe (model/family.py) says which norms sit where, which activation, which rotary table and window each layer
has. The math follows transformers' modeling code of each family exactly (float32 RMSNorm, rotate-half rotary
embeddings, its rope scaling), so greedy tokens match it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedchat.model.attention import AttentionMetadata, backend, paged_attention, write_kv
from pagedchat.model.attention import describe as describe_attention
from pagedchat.errors import ModelError
from pagedchat.model import qmm
from pagedchat.model.blocks import block_parts
from pagedchat.model.hf_config import ModelConfig
from pagedchat.model.family import Activation, LayerSpec, NormStyle, Rope, RopeKind
from pagedchat.model.forms import Dense, EmbedTable, Split, path
from pagedchat.model.linear import Builder, PackedWeights, Placement, nbytes


def rope_table(rope: Rope, head_dim: int, positions: int, max_positions: int, device,
               dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, rotary_dim] for a rotary table of a model with max_positions, sin's first half
    negated (see apply_rope). A position's row does not depend on how many rows are built.

    LongRoPE switches to its long factors past the original context: here by position (a token at or past it
    turns with the long table), where transformers switches a whole forward pass by its longest position."""
    inv_freq, scale = rope.inv_freq(head_dim, max_positions)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    if rope.kind is RopeKind.LONGROPE and rope.original_max_positions < positions:
        long, _ = rope.inv_freq(head_dim, max_positions, long=True)
        past = torch.arange(rope.original_max_positions, positions, dtype=torch.float32)[:, None]
        freqs[rope.original_max_positions:] = past * long[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    sin[:, : inv_freq.shape[0]].neg_()
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


class RotaryTable:
    """One rotary table, built only as far as the longest context a step has reached (doubling as it grows).
    Built to the model's whole context up front, a 128k-position table would take more memory than the KV
    pages of many chats."""

    FIRST_ROWS = 1024

    def __init__(self, rope: Rope, head_dim: int, max_positions: int, device, dtype):
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0, device=device, dtype=dtype)

    def at(self, positions: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rotary_dim] at positions, each below longest."""
        if longest > self.cos.shape[0]:
            rows = max(longest, min(max(2 * self.cos.shape[0], self.FIRST_ROWS), self.max_positions))
            self.cos, self.sin = rope_table(self.rope, self.head_dim, rows, self.max_positions, self.device,
                                            self.dtype)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, round to the model's dtype, then scale. torch's fused
    rms_norm does the fp32 part in one op instead of five, with the same result bit for bit."""
    h = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * h.to(x.dtype)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scale by (1 + w) in fp32, then round; weight is 1 + w, already in fp32."""
    return (F.rms_norm(x.float(), x.shape[-1:], eps=eps) * weight).to(x.dtype)


NORMS = {NormStyle.LLAMA: rms_norm, NormStyle.UNIT_OFFSET: rms_norm_unit_offset}
ACTIVATIONS = {Activation.SILU: lambda x: F.silu(x, inplace=True),  # in place: one new tensor, not two
               Activation.GELU_TANH: lambda x: F.gelu(x, approximate="tanh")}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, rotary_dim], sin's first half negated (see rope_table).

    transformers' x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): carrying the sign in sin
    saves a negation per call and rounds the same (a sign flip is exact). A rotary_dim short of head_dim turns
    the leading dims only, as partial rotary (Phi-4-mini) does."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class FusedLayer:
    """A layer's arguments to qmm.decode_layer: its two norms' weights, then the panels of its projections'
    parts (qkv, o, gate_up, down), each part's GGML type id, and each projection's part count."""

    weights: list[torch.Tensor]
    types: list[int]
    parts: list[int]


class Layer:
    def __init__(self, w: dict, prefix: str, config: ModelConfig, build: Builder, spec: LayerSpec):
        names = config.family.weights
        unit_offset = config.family.norm is NormStyle.UNIT_OFFSET
        get = (lambda name: None) if build.cached is not None else w.__getitem__  # noqa: E731 - a cache needs none
        qkv_bias = None
        if config.qkv_bias and build.cached is None:
            qkv_bias = torch.cat([build.placement.dense(get(f"{prefix}.{p}.bias")) for p in names.qkv])
        # One matmul for q, k and v, and one for gate and up: fewer, larger GEMMs per layer.
        self.qkv = build.projection(f"{prefix}.qkv", [get(f"{prefix}.{p}.weight") for p in names.qkv], qkv_bias)
        self.o = build.projection(f"{prefix}.o", [get(f"{prefix}.{names.o}.weight")])
        self.gate_up = build.projection(f"{prefix}.gate_up", [get(f"{prefix}.{p}.weight") for p in names.gate_up])
        self.down = build.projection(f"{prefix}.down", [get(f"{prefix}.{names.down}.weight")])

        def norm(key: str, name: str | None) -> torch.Tensor | None:
            return None if name is None else build.norm(f"{prefix}.{key}", get(f"{prefix}.{name}.weight"), unit_offset)

        self.input_norm = norm("input_norm", names.attn_norm)
        self.post_norm = norm("post_norm", names.mlp_norm)
        self.attn_out_norm = norm("attn_out_norm", names.attn_out_norm)
        self.mlp_out_norm = norm("mlp_out_norm", names.mlp_out_norm)
        q_norm, k_norm = norm("q_norm", names.q_norm), norm("k_norm", names.k_norm)
        # One weight over q's and k's heads side by side: both normed in one call, as they turn in one.
        self.qk_norm = None if q_norm is None else torch.cat(
            (q_norm.expand(config.num_heads, -1), k_norm.expand(config.num_kv_heads, -1)))
        self.spec = spec

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.post_norm, self.attn_out_norm, self.mlp_out_norm, self.qk_norm)
                if t is not None]


@dataclass(frozen=True)
class RunPaths:
    """Which kernels a model runs on here (DecoderModel.run_paths)."""

    projections: tuple[str, ...]  # "64 × Q4_K panels on pagedchat's AVX2 kernels (...)", one per kernel
    layers: str
    attention: str

    def lines(self) -> list[str]:
        return [f"projections: {p}" for p in self.projections] + [f"layers: {self.layers}",
                                                                   f"attention: {self.attention}"]


class DecoderModel:
    def __init__(self, config: ModelConfig, weights: dict | None, device: torch.device, dtype: torch.dtype,
                 quantize: str | None = None, cached: PackedWeights | None = None):
        """weights: torch tensors (a safetensors model) or loader.GGUFTensors; quantize: "int4"/"int8" packs
        dense weights group-wise too (changing their numbers), where packed weights run (the CPU). cached: the
        model as a packed-weights cache saved it (see pagedchat/model/packed_cache.py), in place of weights."""
        self.config = config
        self.device = device
        self.dtype = dtype
        family = config.family
        placement = Placement.choose(dtype, device, quantize)
        build = Builder(placement, *(cached.tensors, cached.forms, cached.embed) if cached else ())
        get = (lambda name: None) if cached else weights.__getitem__  # noqa: E731
        try:
            tied = config.tie_word_embeddings
            self.layers = [Layer(weights, f"model.layers.{i}", config, build, spec)
                           for i, spec in enumerate(config.layers)]
            self.lm_head = build.projection("lm_head", [get("model.embed_tokens.weight" if tied else "lm_head.weight")])
            self.norm = build.norm("norm", get("model.norm.weight"), family.norm is NormStyle.UNIT_OFFSET)
            self.embed = self._embedding(get("model.embed_tokens.weight"), tied, build)
        except KeyError as exc:
            raise ModelError(
                f"the weights lack tensor {exc.args[0]!r}: not a {config.architecture} checkpoint?") from None
        self.precision = cached.precision if cached else " + ".join(dict.fromkeys(build.labels))
        # The weights' huge pages still to come (model/hugepages.py's Collapser): the engine's idle time does it.
        self.huge_pages = cached.huge_pages if cached else None
        self.runs_blocks = build.runs_blocks  # whether pagedchat's kernels run any of it
        self.runs_int4 = build.runs_int4      # whether any of it runs as int4 groups
        self.built: Builder | None = build  # what was built, by key: for the packed-weights cache to save
        self.forms = build.forms            # each tensor's form, by key (run_paths)
        self.placement = placement
        self.norm_fn = NORMS[family.norm]
        self.act = ACTIVATIONS[family.activation]
        # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as transformers rounds it.
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(dtype) if family.embed_scale else None
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qk_size = q_size + kv_size
        self.scale = config.attention_scale or config.head_dim ** -0.5
        tables = {spec.rope: RotaryTable(spec.rope, config.head_dim, config.max_position_embeddings, device, dtype)
                  for spec in config.layers if spec.rope is not None}
        self.rope_tables = [tables.get(spec.rope) for spec in config.layers]
        self.attention = backend(device)  # after the weights: the native path needs pagedchat's kernels loaded
        # A float32 step of packed weights runs its norms, rotary turn with cache write, and silu(gate) * up as
        # one call each of pagedchat's kernels (csrc/layer_level.cpp) instead of several torch ops. Its numbers
        # differ from torch's in the last bits, as the packed matmuls' do; dense weights keep torch's ops, whose
        # float32 tokens equal transformers' bit for bit.
        self.native_steps = self.runs_blocks and dtype == torch.float32 and self.attention == "native"
        self.native_act = self.native_steps and family.activation is Activation.SILU
        # Where a layer's ops are exactly those, a decode step runs it as one call (qmm.decode_layer): the same
        # numbers, without a Python call and a dispatch per op, which at one chat cost a fifth of a step.
        self.fused = [self._fused(layer, table) for layer, table in zip(self.layers, self.rope_tables)]

    def _fused(self, layer: Layer, table: "RotaryTable | None") -> FusedLayer | None:
        if not self.native_act or table is None or layer.qk_norm is not None or layer.attn_out_norm is not None \
                or layer.mlp_out_norm is not None:
            return None
        parts = [block_parts(p) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(p is None for p in parts):
            return None
        return FusedLayer([layer.input_norm, layer.post_norm] + [t for panels, _ in parts for t in panels],
                          [qmm.TYPES[k] for _, kinds in parts for k in kinds], [len(panels) for panels, _ in parts])

    def _embedding(self, weight, tied: bool, build: Builder):
        """The token table: the packed head itself when tied and readable by rows, a packed copy of a
        quantized untied table, else dense in dtype (a plain dense head is the table itself)."""
        source = build.embed
        if source is None:  # building from the weights: pick, and record the pick for a cache
            if tied:
                source = EmbedTable.HEAD if getattr(self.lm_head, "gathers_rows", False) or \
                    getattr(self.lm_head, "weight", None) is not None else EmbedTable.DENSE
            else:
                source = EmbedTable.PACKED if build.placement.packed(weight) is not None else EmbedTable.DENSE
        if source is EmbedTable.HEAD:
            build.embed = source
            return self.lm_head if getattr(self.lm_head, "gathers_rows", False) else self.lm_head.weight
        if source is EmbedTable.PACKED:
            packed = build.projection("embed.table", [weight])
            if getattr(packed, "gathers_rows", False):
                build.embed = source
                return packed
        table = build.dense("embed.table", weight)
        if build.cached is None:
            build.labels.append(build.placement.label(weight, None))
        build.embed = EmbedTable.DENSE
        return table

    def run_paths(self) -> RunPaths:
        """How this model runs here, in words: each projection kernel with the projections it takes, the layers'
        ops, and attention's path. Logged at start; the bench's header shows it."""
        dense = str(self.dtype).removeprefix("torch.") + (", oneDNN packed" if self.placement.onednn else "")
        kernels = Counter(path(f, qmm.describe(), dense) for f in self.forms.values()
                          if not isinstance(f, (Dense, Split)))
        fused = sum(f is not None for f in self.fused)
        ops = "pagedchat's kernels" if self.native_steps else "torch"
        layers = f"norms, rotary and activation on {ops}" + \
            (f"; a decode step runs {fused} of {len(self.fused)} layers as one call each" if fused else "")
        return RunPaths(tuple(f"{n} × {name}" for name, n in kernels.most_common()),
                        layers, describe_attention(self.attention))

    @property
    def weight_precision(self) -> str:
        """What the weights are and how they run, for F2 and the status line: "Q4_1 packed + Q8_0 packed · AVX2"
        (the kernels' level is this process's, so it is not part of a saved label)."""
        return f"{self.precision} · {qmm.short()}" if self.runs_blocks else self.precision

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            x = F.embedding(input_ids, self.embed)
        else:
            x = self.embed.rows(input_ids).to(self.dtype)
        return x if self.embed_scale is None else x * self.embed_scale

    def _held(self) -> list[torch.Tensor]:
        projections = [self.lm_head] + [p for l in self.layers for p in (l.qkv, l.o, l.gate_up, l.down)]
        tensors = [self.norm] + [t for l in self.layers for t in l.norms()]
        tensors += [self.embed] if isinstance(self.embed, torch.Tensor) else self.embed.tensors()
        return tensors + [t for p in projections for t in p.tensors()]

    def weight_bytes(self) -> int:
        """Resident bytes of every weight, each storage once (a tied head and its table share theirs): what
        competes with the KV cache for memory."""
        return nbytes(self._held())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata],
                logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> logits [len(logits_rows), vocab] (float32) for the rows asked for.

        kv: each layer's K and V pages, [pages, block_size, kv_heads, head_dim] each; metas: each layer's
        attention metadata (its layer group's block tables, engine/model_runner.py)."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        norm = qmm.norm if self.native_steps else self.norm_fn
        t = input_ids.shape[0]
        x = self.embed_tokens(input_ids)  # this forward's own tensor: the residual adds below write into it
        # rotary table -> (cos, sin) at this step's positions, [T, 1, rotary dims] and as the kernels take them,
        # [T, rotary dims]: looked up once per table and step
        turns = {}
        for layer, table, (k_cache, v_cache), meta, fused in zip(self.layers, self.rope_tables, kv, metas, self.fused):
            if table is not None and id(table) not in turns:
                turn = table.at(positions, meta.max_context_len)
                turns[id(table)] = turn, tuple(c.view(t, -1) for c in turn)
            turn, flat = turns.get(id(table), (None, None))
            if fused is not None and meta.decode_only:
                cos, sin = flat
                qmm.decode_layer(x, fused.weights, fused.types, fused.parts, eps, cos, sin, meta.slot_mapping,
                                 k_cache, v_cache, cfg.num_heads, cfg.num_kv_heads, meta.block_tables,
                                 meta.context_lens, self.scale, layer.spec.window or 0)
                continue
            h = norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h)
            if self.native_steps and turn is not None and layer.qk_norm is None:
                cos, sin = flat
                q = qmm.rope_write(qkv, cos, sin, meta.slot_mapping, k_cache, v_cache, cfg.num_heads,
                                   cfg.num_kv_heads)
            else:
                q = self._turn_and_write(qkv, layer, turn, k_cache, v_cache, meta)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self.attention, layer.spec.window)
            out = layer.o(attn.reshape(t, -1))
            x.add_(out if layer.attn_out_norm is None else norm(out, layer.attn_out_norm, eps))
            h = norm(x, layer.post_norm, eps)
            out = layer.down(self._act_mul(layer.gate_up(h)))
            x.add_(out if layer.mlp_out_norm is None else norm(out, layer.mlp_out_norm, eps))
        x = norm(x[logits_rows], self.norm, eps)
        return self.lm_head(x).float()

    def _turn_and_write(self, qkv: torch.Tensor, layer: Layer, turn, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """torch's ops: q and k normed (where the family has q/k norms) and turned, k and v written into the
        cache; returns q [T, heads, head_dim]."""
        cfg, t = self.config, qkv.shape[0]
        # q and k sit side by side in qkv: one norm call and one rotary call treat both.
        qk = qkv[:, : self.qk_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if layer.qk_norm is not None:
            qk = self.norm_fn(qk, layer.qk_norm, cfg.rms_norm_eps)
        if turn is not None:
            qk = apply_rope(qk, *turn)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, self.qk_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        write_kv(k_cache, v_cache, k, v, meta, self.attention)
        return q

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native_act:
            return qmm.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate).mul(up)
