"""Tiny random models of every family pagedchat runs, from transformers' own configs, with a real byte-level
tokenizer and a ChatML template, built in seconds."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen3Config, SmolLM3Config)

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks.",
    "def main():\n    print('hello world')\n    return 0\n",
    "You are a helpful assistant. Answer briefly and precisely, with examples where useful.",
    "Memory is the bottleneck of serving; copy-on-write shares prefixes between sequences.",
]
VOCAB_SIZE = 320


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok.to_str()


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                  bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def _family_config(arch: str, common: dict, rope: dict | None, window: int | None):
    """transformers' own config of that family, over the common shape."""
    default = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters=rope or default)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "qwen3":
        return Qwen3Config(**common, rope_parameters=rope or {"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "smollm3":  # layers 4, 8, ... rotate nothing
        return SmolLM3Config(**common, rope_parameters=rope or {"rope_type": "default", "rope_theta": 2000000.0})
    if arch == "mistral":
        return MistralConfig(**common, rope_parameters=rope or default, sliding_window=window)
    if arch == "gemma3":  # every sixth layer global (the real pattern, which llama.cpp assumes), each kind its base
        ropes = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": rope or {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        return Gemma3TextConfig(**common, rope_parameters=ropes, sliding_window=window or 4096,
                                query_pre_attn_scalar=common["head_dim"])
    if arch == "phi3":
        rotary = int(common["head_dim"] * 0.75)  # Phi-4-mini's partial rotary
        longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                    "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
                    "long_factor": [1.0 + 2.0 * i for i in range(rotary // 2)]}
        return Phi3Config(**common, rope_parameters=rope or longrope, sliding_window=window,
                          original_max_position_embeddings=common["max_position_embeddings"] // 4)
    raise ValueError(arch)


def make_tiny_model(folder: Path, arch: str = "llama", *, tie: bool = True, layers: int = 3, heads: int = 4,
                    kv_heads: int = 2, head_dim: int = 16, seed: int = 0, max_positions: int = 512,
                    rope_scaling: dict | None = None, window: int | None = None) -> Path:
    """Write a random model folder (config.json, model.safetensors, tokenizer) and return it. arch: llama,
    qwen2, qwen3, smollm3, mistral, gemma3, phi3; rope_scaling: the (global) layers' rope_parameters;
    window: the sliding window of the layers that have one."""
    folder = Path(folder)
    tok = make_tokenizer()
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=tie,
                  rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    config = _family_config(arch, common, rope_scaling, window)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default weights make the logits spread out, so greedy ties are rare and tests meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def load_reference(folder: Path):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Transformers' greedy continuation of prompt_ids: the reference every parity test compares with."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=list(eos_ids) or None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
