"""The tiny GGUF files of every family, run by llama.cpp itself: its greedy tokens equal transformers' on the
file's numbers, up to int8 activations' near-ties.

The other GGUF tests check pagedchat's reader against tiny_gguf's writer, which follows llama.cpp's converter
as read. This one checks the writer against llama.cpp: a file laid out otherwise (tensor names, q/k row order,
Gemma's 1 + w norms, rope bases, the sliding-window pattern) would give llama.cpp other tokens. It needs
llama-cpp-python (`pip install 'pagedchat[llamacpp]'`, never built in CI) and is skipped without it."""

from __future__ import annotations

import numpy as np
import pytest
from parity import NEAR_TIE_PACKED, assert_same_greedy
from slow_cases import slow_after
from test_families import FAMILIES, GGUF_FAMILIES, Q4_K_M, gguf_of, prompt_of
from tiny_models import hf_greedy, make_tiny_model

from pagedchat.model.loader import load_tokenizer

llama_cpp = pytest.importorskip("llama_cpp")

CASES = {"llama": dict(arch="llama"), "qwen2": dict(arch="qwen2"), **{n: FAMILIES[n] for n in GGUF_FAMILIES}}
# llama.cpp differs from transformers on Phi-3 in two documented ways, both kept out of this comparison: it
# ignores Phi's sliding window (disabled in its loader), and it picks LongRoPE's long or short factors by the
# context it was given (its n_ctx, padded to 256) rather than by the sequence's length. A context of 2048
# leaves the original context (a quarter) above llama.cpp's 256, so both use the short factors.
CASES["phi3-longrope-partial"] = {**CASES["phi3-longrope-partial"], "window": None, "max_positions": 2048}
NEW_TOKENS = 20


def llama_cpp_greedy(path, prompt: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's own greedy continuation: the argmax of each step's logits, fed back one token at a time."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=1, logits_all=True,
                          verbose=False)
    try:
        llm.eval(prompt)
        out = []
        for _ in range(new_tokens):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(token)
            llm.eval([token])
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("types", slow_after([{"*": "Q8_0"}, Q4_K_M]), ids=["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_reads_the_tiny_gguf_as_transformers_does(name, types, tmp_path):
    wide = dict(heads=4, head_dim=64) if types is Q4_K_M else {}  # K types need rows of whole 256-blocks
    src = make_tiny_model(tmp_path / "src", **{**CASES[name], **wide})
    folder, path, ref = gguf_of(src, tmp_path, types)
    # 40 tokens cross the families' 24-token windows.
    for n in (9, 40):
        prompt = prompt_of(load_tokenizer(folder), n, salt=n)
        expected = hf_greedy(ref, prompt, NEW_TOKENS, [10**9])
        assert_same_greedy(ref, prompt, llama_cpp_greedy(path, prompt, NEW_TOKENS), expected,
                           near_tie=NEAR_TIE_PACKED)
