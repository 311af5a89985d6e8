"""What the KV cache holds: bytes per token, chats that fit by scheme, waste and sharing at a run's peak, and how
much more KV the weights' own size leaves room for."""

from __future__ import annotations

from dataclasses import dataclass

from pagedchat.backends.base import BackendInfo
from pagedchat.engine.sizing import DEFAULT_GPU_SHARE

BF16_BYTES = 2


@dataclass(frozen=True)
class TokenCost:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str                    # the pages' (kv_cache_dtype)
    dtype_bytes: int
    bytes_per_token_model: int    # 2 x layers x kv heads x row bytes (head dim x bytes; int8: + its scale)
    bytes_per_token_pool: float   # read back: pool bytes / token slots
    pool_bytes: int
    num_pages: int
    block_size: int
    page_bytes: int
    token_slots: int
    max_context: int


def token_cost(config, kv_dtype, info: BackendInfo) -> TokenCost:
    """KV bytes per token: from the model's shape in pages of kv_dtype, and from the pool as the backend declares
    it (its pages' bytes over their tokens)."""
    from pagedchat.kernels import kv_pages

    slots = info.num_pages * info.block_size
    pool_bytes = info.pool_bytes or info.num_pages * info.page_bytes
    return TokenCost(
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        dtype=kv_pages.name(kv_dtype), dtype_bytes=kv_dtype.itemsize,
        bytes_per_token_model=kv_pages.token_bytes(config, kv_dtype), bytes_per_token_pool=pool_bytes / slots,
        pool_bytes=pool_bytes, num_pages=info.num_pages, block_size=info.block_size, page_bytes=info.page_bytes,
        token_slots=slots, max_context=config.max_position_embeddings)


@dataclass(frozen=True)
class Scheme:
    slots_per_chat: int
    chats: int | None          # None: a chat needs no page of its own beyond the shared ones
    waste_slots_per_chat: int
    shared_slots: int = 0      # held once for all chats


@dataclass(frozen=True)
class Capacity:
    chat_tokens: int
    paged_shared: Scheme
    paged: Scheme
    contiguous: Scheme


def capacity(cost: TokenCost, system_tokens: int, chat_tokens: int) -> Capacity:
    """Chats of chat_tokens tokens (system prompt included) that fit in the pool, by scheme."""
    bs, pages, ctx = cost.block_size, cost.num_pages, cost.max_context
    per_chat = -(-chat_tokens // bs)
    shared = system_tokens // bs  # full pages of pure system prompt: the ones chats can share
    waste = per_chat * bs - chat_tokens
    return Capacity(
        chat_tokens=chat_tokens,
        paged_shared=Scheme((per_chat - shared) * bs,
                            max(0, (pages - shared) // (per_chat - shared)) if per_chat > shared else None,
                            waste, shared * bs),
        paged=Scheme(per_chat * bs, pages // per_chat, waste),
        contiguous=Scheme(ctx, cost.token_slots // ctx, ctx - chat_tokens))


CHAT_TOKENS = 2048  # the page-dtype table's chat: vLLM's and the write-up's "concurrent request ceiling" unit


@dataclass(frozen=True)
class DtypeCapacity:
    """One page dtype in the same KV budget: its bytes a token and the CHAT_TOKENS-token chats its pages hold."""

    dtype: str
    bytes_per_token: int
    num_pages: int
    chats: int


def dtype_capacity(config, pool_bytes: int, block_size: int, chat_tokens: int = CHAT_TOKENS) \
        -> tuple[DtypeCapacity, ...]:
    """Every page dtype's pool in pool_bytes (as plan_cache cuts a budget into pages, one group), and the chats of
    chat_tokens tokens, nothing shared, that fit in it."""
    from pagedchat.kernels import kv_pages

    rows = []
    for name in kv_pages.KV_CACHE_DTYPES[1:]:
        per_token = kv_pages.token_bytes(config, kv_pages.parse_kv_cache_dtype(name))
        pages = pool_bytes // (per_token * block_size)
        rows.append(DtypeCapacity(name, per_token, pages, pages // -(-chat_tokens // block_size)))
    return tuple(rows)


def pages_needed(prompts: list[list[int]], max_tokens: int, system_tokens: int, block_size: int) -> int:
    """Pages the workload holds at most with its system prompt shared."""
    shared = system_tokens // block_size
    return shared + sum(-(-(len(p) + max_tokens) // block_size) - shared for p in prompts)


@dataclass(frozen=True)
class SeqHeld:
    request_id: str
    tokens: int
    pages: int


@dataclass(frozen=True)
class PeakAccounting:
    """Allocated against used slots at a run's peak, paged (as it is) and contiguous (as it would be)."""

    chats_live: int
    tokens_held: int               # K/V stored, counted per chat
    unique_tokens_held: int        # counted once per shared page
    paged_slots: int
    paged_waste_slots: int
    contiguous_slots: int
    contiguous_waste_slots: int
    pages_with_sharing: int
    pages_without_sharing: int     # computed: each chat's own ceil(tokens / block_size)
    pages_saved: int
    pages_saved_by_refcount: int   # the snapshot's own count, as a cross-check
    seqs: tuple[SeqHeld, ...]


def peak_accounting(snap, max_context: int) -> PeakAccounting:
    bs = snap.block_size
    fill: dict[int, int] = {}  # page -> tokens it holds; a shared page holds the same tokens for every owner
    seqs = []
    for seq in snap.seqs.values():
        held = seq.num_computed
        seqs.append(SeqHeld(seq.request_id, held, len(seq.pages)))
        for j, page in enumerate(seq.pages):
            fill[page] = max(fill.get(page, 0), min(bs, max(0, held - j * bs)))
    tokens = sum(s.tokens for s in seqs)
    unique_tokens = sum(fill.values())
    used = snap.used_pages
    unshared = sum(-(-s.tokens // bs) for s in seqs)
    n = len(seqs)
    return PeakAccounting(
        chats_live=n, tokens_held=tokens, unique_tokens_held=unique_tokens,
        paged_slots=used * bs, paged_waste_slots=used * bs - unique_tokens,
        contiguous_slots=n * max_context, contiguous_waste_slots=n * max_context - tokens,
        pages_with_sharing=used, pages_without_sharing=unshared, pages_saved=unshared - used,
        pages_saved_by_refcount=snap.pages_saved_by_sharing, seqs=tuple(seqs))


@dataclass(frozen=True)
class Sharing:
    pages_with: int
    pages_without: int        # computed, as in PeakAccounting
    pages_saved: int
    prompt_tokens: int
    prefill_tokens_computed: int
    prefill_tokens_saved: int


def parameter_count(config) -> int:
    """Weights of a decoder, counted from its shape and its family's layer recipe (its norms; packing changes the
    weights' bytes, not their number)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    names = config.family.weights
    attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if config.qkv_bias else 0)
    norms = sum(n is not None for n in (names.attn_norm, names.attn_out_norm, names.mlp_norm, names.mlp_out_norm))
    head_norms = sum(n is not None for n in (names.q_norm, names.k_norm)) * config.head_dim
    layer = attn + 3 * h * i + norms * h + head_norms
    return v * h * (1 if config.tie_word_embeddings else 2) + config.num_layers * layer + h


@dataclass(frozen=True)
class KvRoom:
    """KV bytes and tokens a memory budget leaves once the weights are in, by one sizing rule."""

    kv_bytes: int
    tokens: int


@dataclass(frozen=True)
class WeightCapacity:
    """The weights beside the KV pool, and the KV tokens the same memory holds with these weights against bf16."""

    parameters: int
    weight_bytes: int          # resident, as loaded (packed or not)
    bf16_weight_bytes: int     # parameters x 2
    kv_pool_bytes: int
    kv_bytes_per_token: int
    budget_bytes: int          # fixed budget: bf16 weights + this run's KV pool
    fixed_loaded: KvRoom       # budget - these weights
    fixed_bf16: KvRoom         # budget - bf16 weights
    gpu_free_bytes: int        # free memory the GPU rule starts from (the GPU's own on CUDA, else the budget)
    gpu_free_measured: bool
    gpu_loaded: KvRoom         # 60% of (free - these weights), at most the engine's ceiling
    gpu_bf16: KvRoom
    fixed_extra_tokens: int    # KV tokens these weights leave room for beyond bf16's (negative: fewer)
    gpu_extra_tokens: int


def _room(kv_bytes: float, per_token: int) -> KvRoom:
    kv = max(0, int(kv_bytes))
    return KvRoom(kv, kv // per_token)


def weight_capacity(parameters: int, weight_bytes: int, cost: TokenCost, ceiling_bytes: int,
                    gpu_free_bytes: int | None = None) -> WeightCapacity:
    """gpu_free_bytes: free GPU memory before the weights load, when there is a GPU; else the fixed budget stands
    in for it. ceiling_bytes: the engine's own cap on a default pool (pagedchat/engine/sizing.py)."""
    bf16 = parameters * BF16_BYTES
    per_token = cost.bytes_per_token_model
    budget = bf16 + cost.pool_bytes
    free = budget if gpu_free_bytes is None else gpu_free_bytes

    def gpu_rule(weights: int) -> KvRoom:  # as plan_cache sizes a pool once the weights are loaded
        return _room(min(DEFAULT_GPU_SHARE * (free - weights), ceiling_bytes), per_token)

    fixed_loaded, fixed_bf16 = _room(budget - weight_bytes, per_token), _room(budget - bf16, per_token)
    gpu_loaded, gpu_bf16 = gpu_rule(weight_bytes), gpu_rule(bf16)
    return WeightCapacity(
        parameters=parameters, weight_bytes=weight_bytes, bf16_weight_bytes=bf16, kv_pool_bytes=cost.pool_bytes,
        kv_bytes_per_token=per_token, budget_bytes=budget, fixed_loaded=fixed_loaded, fixed_bf16=fixed_bf16,
        gpu_free_bytes=free, gpu_free_measured=gpu_free_bytes is not None, gpu_loaded=gpu_loaded, gpu_bf16=gpu_bf16,
        fixed_extra_tokens=fixed_loaded.tokens - fixed_bf16.tokens,
        gpu_extra_tokens=gpu_loaded.tokens - gpu_bf16.tokens)
