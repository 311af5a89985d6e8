"""`pagedchat bench`: what the paged KV cache buys, measured on this machine.

One run answers, side by side:
  1. what one token of context costs (from the model's shape, and from the pool's pages as the engine declares them);
  2. how many chats fit in the KV budget when paged, against reserving the model's full context per chat, the
     slots each scheme wastes on the real run, and the weights' bytes beside the pool's: how many more KV tokens
     the same memory holds with these weights than with bf16 ones;
  3. how many pages N chats with one S-token system prompt use with prefix sharing, against without;
  4. speed at each concurrency (end-to-end and decode tokens/s, time to first token, inter-token latency),
     and a cold against a warm (system prompt already cached) first token;
  5. with --against transformers and/or llama.cpp, the same token ids on those peers, as ratios; and the time
     from start to model ready in a fresh process.

The workload is fixed: a realistic system prompt cut or padded to exactly --system-tokens tokens, distinct user
questions chosen by --seed, greedy decoding, and every reply forced to --max-tokens tokens.

Modules: config (what a run is asked), workload, stats, memory (KV and weight accounting), engine_runner
(pagedchat's side, through the backend face), peers with hf and llamacpp (found through loaders), startup,
harness (the rounds), report (the typed result), render (tables), command (the CLI), app_probe (--app: the real
app on a pseudo-terminal against its engine).
"""

from pagedchat.bench.command import add_arguments, run, with_defaults

__all__ = ["add_arguments", "run", "with_defaults"]
