"""llama.cpp on the same token ids, through the user's own llama-cpp-python (`pip install 'pagedchat[llamacpp]'`).

It runs on the GGUF file the model came from, through llama.cpp's own C API (the binding's low-level layer), and
shares the system prompt the way llama.cpp's `parallel` example does: the prefix is decoded once into sequence
0, then `llama_memory_seq_cp` gives it to every chat's sequence over one unified KV cache; all chats' prompts,
then one token per chat, go in one `llama_batch` per `llama_decode`. Sampling is llama.cpp's greedy sampler
behind a logit bias that bans end-of-generation tokens, so every reply runs to --max-tokens as pagedchat's do.
"""

from __future__ import annotations

import ctypes
import importlib.util
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from pagedchat.bench.options import BenchError
from pagedchat.bench.peers import Peer, Runner
from pagedchat.bench.progress import NoProgress, on_own_thread
from pagedchat.bench.startup import READY, time_to_ready
from pagedchat.bench.stats import RunStats, timing_stats

MISSING = ("--against llama.cpp needs llama-cpp-python: pip install 'pagedchat[llamacpp]' "
           "(it builds llama.cpp; CMAKE_ARGS=-DGGML_NATIVE=ON builds it for this CPU)")
LABEL = "llama.cpp, shared prompt"


def require() -> None:
    """Stop with one line, before anything loads, when llama-cpp-python is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BenchError(MISSING)


def gguf_file(model: str | None, keep: Path) -> Path:
    """The GGUF the bench's model came from. The default model's is fetched into `keep` unless its folder holds it."""
    if model is None:
        from pagedchat.model.pull import default_model_dir, fetch_default_gguf

        found = sorted(default_model_dir().glob("*.gguf"))
        return found[0] if found else fetch_default_gguf(keep)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if found:
        return found[0]
    raise BenchError(f"--against llama.cpp runs the GGUF file the model came from, and {model} has none: "
                     "pass --model FILE.gguf")


def _quiet(lib):
    """llama.cpp logs every load to stderr; the bench's own lines are what the user asked for."""
    callback = lib.llama_log_callback(lambda level, text, data: None)
    lib.llama_log_set(callback, ctypes.c_void_p())
    return callback  # kept alive by the caller: llama.cpp holds the pointer


class Batch:
    """A llama_batch that is filled, decoded, cleared: one token per entry, each in one sequence."""

    def __init__(self, lib, capacity: int, n_seq_max: int):
        self.lib = lib
        self.capacity = capacity
        self.raw = lib.llama_batch_init(capacity, 0, n_seq_max)

    def clear(self) -> None:
        self.raw.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token; its index in the batch (the index its logits are sampled at)."""
        i = self.raw.n_tokens
        self.raw.token[i] = token
        self.raw.pos[i] = pos
        self.raw.n_seq_id[i] = 1
        self.raw.seq_id[i][0] = seq
        self.raw.logits[i] = logits
        self.raw.n_tokens = i + 1
        return i

    def free(self) -> None:
        self.lib.llama_batch_free(self.raw)


class LlamaCpp:
    """One loaded GGUF model, with a greedy sampler that never picks an end-of-generation token."""

    def __init__(self, path: Path, threads: int, vocab_size: int, eos_ids: frozenset[int]):
        import llama_cpp as lib

        self.lib = lib
        self.threads = threads
        self._log = _quiet(lib)
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise BenchError(f"llama.cpp could not load {path}")
        vocab = lib.llama_model_get_vocab(self.model)
        n_vocab = lib.llama_vocab_n_tokens(vocab)
        if n_vocab != vocab_size:
            lib.llama_model_free(self.model)
            raise BenchError(f"{path.name} has {n_vocab} tokens but the bench's model {vocab_size}: "
                             "not the file the model came from")
        banned = sorted({t for t in range(n_vocab) if lib.llama_vocab_is_eog(vocab, t)} | set(eos_ids))
        biases = (lib.llama_logit_bias * len(banned))(*[lib.llama_logit_bias(t, float("-inf")) for t in banned])
        self.sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_logit_bias(n_vocab, len(banned), biases))
        lib.llama_sampler_chain_add(self.sampler, lib.llama_sampler_init_greedy())

    @contextmanager
    def context(self, n_seqs: int, n_ctx: int):
        """A context of n_seqs sequences over one unified KV cache of n_ctx cells, with a batch to fill."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_seq_max = n_seqs
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise BenchError(f"llama.cpp could not create a context of {n_ctx} tokens for {n_seqs} sequences")
        # llama_decode takes at most n_batch tokens, which llama.cpp may have lowered to fit n_ctx.
        batch = Batch(lib, lib.llama_n_batch(ctx), n_seqs)
        try:
            yield ctx, batch
        finally:
            batch.free()
            lib.llama_free(ctx)

    def _decode(self, ctx, batch: Batch) -> None:
        if self.lib.llama_decode(ctx, batch.raw) != 0:
            raise BenchError(f"llama_decode failed on a batch of {batch.raw.n_tokens} tokens")

    def _prefill(self, ctx, batch: Batch, entries: list[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
        """Decode (token, pos, seq, wants logits) entries in chunks of the batch's size, sampling each entry that
        wants logits right after its chunk: [(seq, token)] in entry order."""
        sampled = []
        for at in range(0, len(entries), batch.capacity):
            chunk = entries[at:at + batch.capacity]
            batch.clear()
            index = [batch.add(tok, pos, seq, logits) for tok, pos, seq, logits in chunk]
            self._decode(ctx, batch)
            sampled += [(seq, self.lib.llama_sampler_sample(self.sampler, ctx, i))
                        for i, (_, _, seq, logits) in zip(index, chunk) if logits]
        return sampled

    def run_level(self, prompts: list[list[int]], system_len: int, max_tokens: int, progress) -> RunStats:
        """All chats at once, their system prompt decoded once and shared by llama_memory_seq_cp."""
        lib, n = self.lib, len(prompts)
        n_ctx = system_len + sum(len(p) - system_len + max_tokens for p in prompts) + 1
        with self.context(n + 1, n_ctx) as (ctx, batch):
            mem = lib.llama_get_memory(ctx)
            arrivals: list[list[float]] = [[] for _ in prompts]
            start = time.perf_counter()
            self._prefill(ctx, batch, [(t, pos, 0, False) for pos, t in enumerate(prompts[0][:system_len])])
            for s in range(1, n + 1):
                lib.llama_memory_seq_cp(mem, 0, s, -1, -1)
            turns = [(t, system_len + j, s + 1, system_len + j == len(p) - 1)
                     for s, p in enumerate(prompts) for j, t in enumerate(p[system_len:])]
            last = {}
            for seq, token in self._prefill(ctx, batch, turns):
                last[seq] = token
                arrivals[seq - 1].append(time.perf_counter())
            progress.advance(n)
            for step in range(1, max_tokens):
                batch.clear()
                for s, p in enumerate(prompts):
                    batch.add(last[s + 1], len(p) + step - 1, s + 1, True)
                self._decode(ctx, batch)
                for s in range(n):
                    last[s + 1] = lib.llama_sampler_sample(self.sampler, ctx, s)
                    arrivals[s].append(time.perf_counter())
                progress.advance(n)
        return timing_stats(start, arrivals)

    def cold_first_token(self, prompts: list[list[int]]) -> list[float]:
        """Each prompt alone on an empty cache: seconds to its first token."""
        times = []
        with self.context(1, max(len(p) for p in prompts) + 1) as (ctx, batch):
            for p in prompts:
                self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
                t0 = time.perf_counter()
                self._prefill(ctx, batch, [(t, pos, 0, pos == len(p) - 1) for pos, t in enumerate(p)])
                times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.lib.llama_sampler_free(self.sampler)
        self.lib.llama_model_free(self.model)


# The startup probe: a fresh interpreter that loads the GGUF and makes a context, as a chat program would.
_READY = """\
import ctypes, sys
import llama_cpp as lib
keep = lib.llama_log_callback(lambda level, text, data: None)
lib.llama_log_set(keep, ctypes.c_void_p())
lib.llama_backend_init()
model = lib.llama_model_load_from_file(sys.argv[1].encode(), lib.llama_model_default_params())
params = lib.llama_context_default_params()
params.n_threads = params.n_threads_batch = int(sys.argv[2])
ctx = lib.llama_init_from_model(model, params)
if model and ctx:
    """ + READY + "\n"


def peer(cfg, engine, work) -> Peer:
    import torch

    require()
    keep = tempfile.TemporaryDirectory(prefix="pagedchat-bench-gguf-")
    try:
        path = gguf_file(cfg.model, Path(keep.name))
        threads = cfg.threads or torch.get_num_threads()
        llama = on_own_thread(LlamaCpp, path, threads, engine.config.vocab_size, engine.eos_token_ids)
    except BaseException:
        keep.cleanup()
        raise
    system_len = len(work.system_ids)
    on_own_thread(llama.run_level, [work.cold_prefix(1)[:32] + work.post], 16, 2, NoProgress())  # warm-up

    def run(prompts, max_tokens, progress):
        return on_own_thread(llama.run_level, prompts, system_len, max_tokens, progress)

    def close():
        llama.close()
        keep.cleanup()

    return Peer("llama.cpp", (Runner("llama.cpp", LABEL, True, run),), close=close,
                cold_first_token=lambda prompts: on_own_thread(llama.cold_first_token, prompts),
                startup=lambda: time_to_ready(["-c", _READY, str(path), str(threads)]), build=build_flags())


def build_flags() -> str:
    """The CPU features this llama.cpp was built for, from its own system info: which level it runs at."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    flags = [part.split("=")[0].strip() for part in info.split("|") if part.strip().endswith("= 1")]
    return "built for " + " ".join(f.split(":")[-1].strip() for f in flags)
