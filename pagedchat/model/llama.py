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
from pagedchat.model.config import ModelConfig
from pagedchat.model.linear import Linear, packing_is_exact


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
    def __init__(self, w: dict[str, torch.Tensor], prefix: str, config: ModelConfig, packed: bool):
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        # One matmul for q, k and v, and one for gate and up: fewer, larger GEMMs per layer.
        qkv_bias = torch.cat([w[f"{attn}.{p}_proj.bias"] for p in "qkv"]) if config.qkv_bias else None
        self.qkv = Linear(torch.cat([w[f"{attn}.{p}_proj.weight"] for p in "qkv"]), qkv_bias, packed)
        self.o = Linear(w[f"{attn}.o_proj.weight"], packed=packed)
        self.gate_up = Linear(torch.cat([w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]]), packed=packed)
        self.down = Linear(w[f"{mlp}.down_proj.weight"], packed=packed)
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_norm = w[f"{prefix}.post_attention_layernorm.weight"]


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        try:
            self.embed = w["model.embed_tokens.weight"]
            self.norm = w["model.norm.weight"]
            self.packed_weights = packing_is_exact(self.embed)  # any weight of the model's dtype tells
            head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
            self.lm_head = Linear(head, packed=self.packed_weights)
            self.layers = [Layer(w, f"model.layers.{i}", config, self.packed_weights)
                           for i in range(config.num_layers)]
        except KeyError as exc:
            raise ModelError(
                f"the weights lack tensor {exc.args[0]!r}: not a {config.architecture} checkpoint?") from None
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

    def weight_bytes(self) -> int:
        """Resident bytes of every weight: what competes with the KV cache for memory."""
        tensors = [self.embed, self.norm] + [t for l in self.layers for t in (l.input_norm, l.post_norm)]
        linears = [l for layer in self.layers for l in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        tied = self.lm_head.weight is self.embed
        return (sum(t.untyped_storage().nbytes() for t in tensors) + sum(l.nbytes for l in linears)
                + (0 if tied else self.lm_head.nbytes))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> logits [len(logits_rows), vocab] (float32) for the rows asked for.

        kv_cache is [layers, 2, pages, block_size, kv_heads, head_dim]."""
        cfg = self.config
        t = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            # q and k sit side by side in qkv: one rotary call turns both.
            qk = apply_rope(qkv[:, : self.qk_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self.qk_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            write_kv(k_cache, v_cache, k, v, meta, self.use_triton)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self.use_triton)
            x = x + layer.o(attn.reshape(t, -1))
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = rms_norm(x[logits_rows], self.norm, cfg.rms_norm_eps)
        return self.lm_head(x).float()
