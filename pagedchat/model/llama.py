"""A Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Qwen2) over a flat token batch and a paged KV cache.

Tokens of all scheduled sequences are packed into one [T, hidden] batch with no padding; positions say where
each sits in its own sequence, and the attention metadata says which pages hold its context. The math follows
transformers' LlamaForCausalLM exactly (float32 RMSNorm, rotate-half rotary embeddings, the llama3 frequency
scaling), so greedy tokens match it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedchat.attention import AttentionMetadata, backend, paged_attention, write_kv
from pagedchat.errors import ModelError
from pagedchat.model import int4_kernel, qmm
from pagedchat.model.config import ModelConfig
from pagedchat.model.linear import Builder, Placement, nbytes


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    # Llama 3.1's rule: stretch low frequencies by `factor`, keep high ones, blend the band between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, round to the model's dtype, then scale. torch's fused
    rms_norm does the fp32 part in one op instead of five, with the same result bit for bit."""
    h = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim], sin's first half negated (see LlamaModel.__init__).

    transformers' x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): carrying the sign in sin
    saves a negation per call and rounds the same (a sign flip is exact)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class Layer:
    def __init__(self, w: dict, prefix: str, config: ModelConfig, build: Builder):
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        get = (lambda name: None) if build.cached is not None else w.__getitem__  # noqa: E731 - a cache needs none
        qkv_bias = None
        if config.qkv_bias and build.cached is None:
            qkv_bias = torch.cat([build.placement.dense(get(f"{attn}.{p}_proj.bias")) for p in "qkv"])
        # One matmul for q, k and v, and one for gate and up: fewer, larger GEMMs per layer.
        self.qkv = build.projection(f"{prefix}.qkv", [get(f"{attn}.{p}_proj.weight") for p in "qkv"], qkv_bias)
        self.o = build.projection(f"{prefix}.o", [get(f"{attn}.o_proj.weight")])
        self.gate_up = build.projection(f"{prefix}.gate_up", [get(f"{mlp}.{p}_proj.weight") for p in ("gate", "up")])
        self.down = build.projection(f"{prefix}.down", [get(f"{mlp}.down_proj.weight")])
        self.input_norm = build.dense(f"{prefix}.input_norm", get(f"{prefix}.input_layernorm.weight"))
        self.post_norm = build.dense(f"{prefix}.post_norm", get(f"{prefix}.post_attention_layernorm.weight"))


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict | None, device: torch.device, dtype: torch.dtype,
                 quantize: str | None = None, cached: "PackedWeights | None" = None):
        """weights: torch tensors (a safetensors model) or loader.GGUFTensors; quantize: "int4"/"int8" packs
        dense weights group-wise too (changing their numbers), where packed weights run (the CPU). cached: the
        model as a packed-weights cache saved it (see pagedchat/model/packed_cache.py), in place of weights."""
        self.config = config
        self.device = device
        self.dtype = dtype
        placement = Placement.choose(dtype, device, quantize)
        build = Builder(placement, *(cached.tensors, cached.forms) if cached else ())
        get = (lambda name: None) if cached else weights.__getitem__  # noqa: E731
        try:
            tied = config.tie_word_embeddings
            self.layers = [Layer(weights, f"model.layers.{i}", config, build) for i in range(config.num_layers)]
            self.lm_head = build.projection("lm_head", [get("model.embed_tokens.weight" if tied else "lm_head.weight")])
            self.norm = build.dense("norm", get("model.norm.weight"))
            self.embed = self._embedding(get("model.embed_tokens.weight"), tied, build)
        except KeyError as exc:
            raise ModelError(
                f"the weights lack tensor {exc.args[0]!r}: not a {config.architecture} checkpoint?") from None
        self.precision = cached.precision if cached else " + ".join(dict.fromkeys(build.labels))
        self.runs_blocks = build.runs_blocks  # whether pagedchat's kernels run any of it
        self.runs_int4 = build.runs_int4      # whether any of it runs as int4 groups
        if self.runs_int4:
            int4_kernel.ensure(wait=False)  # batched int4 steps switch to it once it is loaded
        self.built: Builder | None = build  # what was built, by key: for the packed-weights cache to save
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qk_size = q_size + kv_size
        self.scale = config.head_dim ** -0.5
        inv_freq = rope_inv_freq(config)
        freqs = torch.arange(config.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin()
        sin[:, : config.head_dim // 2].neg_()
        self.sin = sin.to(device=device, dtype=dtype)
        self.use_triton = backend(device) == "triton"
        self._views_of: torch.Tensor | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _embedding(self, weight, tied: bool, build: Builder):
        """The token table: the packed head itself when tied and readable by rows, a packed copy of a
        quantized untied table, else dense in dtype (a plain dense head is the table itself)."""
        form = build.forms.get("embed")
        if form is None:  # building from the weights: pick, and record the pick for a cache
            if tied:
                form = "head" if getattr(self.lm_head, "gathers_rows", False) or \
                    getattr(self.lm_head, "weight", None) is not None else "dense"
            else:
                form = "packed" if build.placement.packed(weight) is not None else "dense"
        if form == "head":
            build.forms["embed"] = "head"
            return self.lm_head if getattr(self.lm_head, "gathers_rows", False) else self.lm_head.weight
        if form == "packed":
            packed = build.projection("embed.table", [weight])
            if getattr(packed, "gathers_rows", False):
                build.forms["embed"] = "packed"
                return packed
        table = build.dense("embed.table", weight)
        if build.cached is None:
            build.labels.append(build.placement.label(weight, None))
        build.forms["embed"] = "dense"
        return table

    @property
    def weight_precision(self) -> str:
        """What the weights are and how they run, for F2 and the status line: "Q4_1 packed + Q8_0 packed · AVX2"
        (the kernels' level is this process's, so it is not part of a saved label)."""
        return f"{self.precision} · {qmm.short()}" if self.runs_blocks else self.precision

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(input_ids, self.embed)
        return self.embed.rows(input_ids).to(self.dtype)

    def _held(self) -> list[torch.Tensor]:
        projections = [self.lm_head] + [p for l in self.layers for p in (l.qkv, l.o, l.gate_up, l.down)]
        tensors = [self.norm] + [t for l in self.layers for t in (l.input_norm, l.post_norm)]
        tensors += [self.embed] if isinstance(self.embed, torch.Tensor) else self.embed.tensors()
        return tensors + [t for p in projections for t in p.tensors()]

    def weight_bytes(self) -> int:
        """Resident bytes of every weight, each storage once (a tied head and its table share theirs): what
        competes with the KV cache for memory."""
        return nbytes(self._held())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> logits [len(logits_rows), vocab] (float32) for the rows asked for.

        kv_cache is [layers, 2, pages, block_size, kv_heads, head_dim]."""
        cfg = self.config
        t = input_ids.shape[0]
        x = self.embed_tokens(input_ids)  # this forward's own tensor: the residual adds below write into it
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, self._cache_views(kv_cache)):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            # q and k sit side by side in qkv: one rotary call turns both.
            qk = apply_rope(qkv[:, : self.qk_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self.qk_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
            write_kv(k_cache, v_cache, k, v, meta, self.use_triton)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self.use_triton)
            x.add_(layer.o(attn.reshape(t, -1)))
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x.add_(layer.down(F.silu(gate, inplace=True).mul(up)))  # SiLU in place: one new tensor, not two
        x = rms_norm(x[logits_rows], self.norm, cfg.rms_norm_eps)
        return self.lm_head(x).float()

    def _cache_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V pages, sliced once per cache rather than twice per layer in every step."""
        if self._views_of is not kv_cache:
            self._views = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
            self._views_of = kv_cache
        return self._views
