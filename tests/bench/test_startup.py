"""What start-up skips, checked to change nothing: the KV pool's zero pages (the tokenizer record:
test_tokenizer.py)."""

from __future__ import annotations

import dataclasses

import torch

from pagedchat.engine.model_runner import zeros


def test_lazy_zeros_are_zeros_of_the_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = zeros((3, 2, 5, 16, 2, 8), dtype, torch.device("cpu"))
        assert t.shape == (3, 2, 5, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
        assert torch.equal(t, torch.zeros_like(t))
        t[1, 0, 2] = 1.5  # writable, and a write lands where it would in any tensor
        assert t.sum().item() == 1.5 * 16 * 2 * 8
    assert zeros((2, 0, 16), torch.bfloat16, torch.device("cpu")).shape == (2, 0, 16)  # no CPU tier


def test_f2_and_the_status_line_say_how_the_weights_run(tiny_llama, tmp_path, monkeypatch):
    """F2's summary shows the weights' bytes and precision from the engine's snapshot; the status line says
    how they run through the backend's info."""
    from pagedchat import Engine
    from pagedchat.backends.local import LocalBackend
    from pagedchat.tui.inspector import render_summary

    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path))  # the packed weights are saved there
    from pagedchat.model import qmm

    engine = Engine(str(tiny_llama), kv_cache_memory="4MiB", dtype="float32", quantize="int4")
    precision = engine.model.weight_precision
    assert precision == f"Q4_1 packed (quantized at load) · {qmm.short()}"  # the kernels' level: "AVX2", ...
    snap = engine.memory()
    assert (snap.weight_bytes, snap.weight_precision) == (engine.model.weight_bytes(), precision)
    assert LocalBackend(engine).info.where == f"on cpu · float32 · weights {precision}"
    engine.shutdown()
    text = render_summary(snap, 80).plain
    assert "weights" in text and precision in text
    unknown = dataclasses.replace(snap, weight_bytes=0, weight_precision="")
    assert "weights" not in render_summary(unknown, 80).plain  # a backend that cannot tell shows nothing
