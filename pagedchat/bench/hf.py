"""transformers `generate` on the same prompts: one chat at a time, and one left-padded batch."""

from __future__ import annotations

import time

from pagedchat.bench.options import BenchError
from pagedchat.bench.peers import Peer, Runner
from pagedchat.bench.progress import NoProgress, on_own_thread
from pagedchat.bench.stats import RunStats, timing_stats


class _TokenClock:
    """A transformers streamer that only records when each generated token (or batch of them) appears."""

    def __init__(self, progress, batch: int):
        self.times: list[float] = []
        self.progress = progress
        self.batch = batch
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.progress.advance(self.batch)

    def end(self) -> None:
        pass


def _make_streamer(progress, batch: int):
    from transformers.generation.streamers import BaseStreamer

    class Clock(_TokenClock, BaseStreamer):
        pass

    return Clock(progress, batch)


def load_model(folder, dtype, device):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.to(device).eval()


def generate(model, batch_ids: list[list[int]], max_tokens: int, pad_id: int, progress) -> list[float]:
    import torch

    width = max(len(p) for p in batch_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch_ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_ids], device=model.device)
    clock = _make_streamer(progress, len(batch_ids))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                             streamer=clock)
    if out.shape[1] - width != max_tokens:
        raise BenchError(f"transformers generated {out.shape[1] - width} tokens instead of {max_tokens}")
    return clock.times


def run_one_at_a_time(model, prompts: list[list[int]], max_tokens: int, pad_id: int, progress) -> RunStats:
    start = time.perf_counter()
    arrivals = [generate(model, [p], max_tokens, pad_id, progress) for p in prompts]
    return timing_stats(start, arrivals)


def run_padded_batch(model, prompts: list[list[int]], max_tokens: int, pad_id: int, progress) -> RunStats:
    start = time.perf_counter()
    times = generate(model, prompts, max_tokens, pad_id, progress)
    return timing_stats(start, [list(times) for _ in prompts])


def peer(engine, work) -> Peer:
    model = on_own_thread(load_model, engine.model_path, engine.dtype, engine.device)
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids or {0})
    # First-call costs off the clock.
    on_own_thread(generate, model, [work.cold_prefix(1)[:32]], 2, pad_id, NoProgress())

    def runner(fn):
        return lambda prompts, max_tokens, progress: on_own_thread(fn, model, prompts, max_tokens, pad_id, progress)

    return Peer("transformers", (
        Runner("transformers_padded_batch", "transformers, padded batch", True, runner(run_padded_batch)),
        Runner("transformers_one_at_a_time", "transformers, one at a time", False, runner(run_one_at_a_time)),
    ), close=lambda: None)
