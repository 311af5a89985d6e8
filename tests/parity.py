"""Greedy parity with transformers, tolerating only genuine float near-ties."""

import torch

NEAR_TIE = 1e-4
# bf16 keeps 8 significant bits: logits around 20 are spaced 0.125 apart, and transformers' own cached
# generate and its full forward pass already disagree by more than that on the default model.
NEAR_TIE_BF16 = 0.5
# Packed weights run on int8 activations (per 32 inputs, as llama.cpp's kernels do), which move a matmul's
# outputs by up to about 1% of their largest: on the default model, as far as bf16 moves its logits.
NEAR_TIE_PACKED = 0.5


def assert_same_greedy(ref_model, prompt: list[int], ours: list[int], expected: list[int],
                       near_tie: float = NEAR_TIE) -> None:
    """ours must equal expected token for token. At the first difference we accept ours only if transformers'
    own logits put our token within NEAR_TIE of its choice (a float near-tie that a different but equally
    valid summation order may flip); the continuations then legitimately diverge, so comparison stops."""
    for i, (a, b) in enumerate(zip(ours, expected)):
        if a == b:
            continue
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + expected[:i]])).logits[0, -1].float()
        gap = (logits[b] - logits[a]).item()
        assert gap <= near_tie, f"token {i}: ours {a}, transformers {b}, logit gap {gap:.3g} is no near-tie"
        return
    assert len(ours) == len(expected), f"lengths differ: ours {len(ours)}, transformers {len(expected)}"
