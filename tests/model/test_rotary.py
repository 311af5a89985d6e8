"""Rotary tables grow with the longest context reached, not to the model's whole context, and a row's values do
not depend on how far the table was built (LongRoPE's switch to its long factors included)."""

from __future__ import annotations

import pytest
import torch

from pagedchat.model.family import base_rope
from pagedchat.model.decoder import RotaryTable, rope_table

CONTEXT = 131072
ROTARY = 24
LONGROPE = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": CONTEXT,
            "original_max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                "short_factor": [1.0 + 0.1 * i for i in range(ROTARY // 2)],
                                "long_factor": [1.0 + 2.0 * i for i in range(ROTARY // 2)]}}
YARN = {"hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": CONTEXT,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 2048}}


@pytest.mark.parametrize("cfg", [LONGROPE, YARN], ids=["longrope", "yarn"])
def test_the_table_grows_with_the_context_and_its_rows_equal_a_full_tables(cfg):
    rope = base_rope(cfg)
    table = RotaryTable(rope, 32, CONTEXT, "cpu", torch.float32)
    full_cos, full_sin = rope_table(rope, 32, 8192, CONTEXT, "cpu", torch.float32)
    for longest in (9, 700, 2050, 5000):  # past the original context of 2048: LongRoPE's long rows
        positions = torch.tensor([0, longest // 2, longest - 1])
        cos, sin = table.at(positions, longest)
        assert torch.equal(cos[:, 0], full_cos[positions]) and torch.equal(sin[:, 0], full_sin[positions])
        assert longest <= table.cos.shape[0] <= max(2 * longest, RotaryTable.FIRST_ROWS)


def test_a_short_context_never_builds_the_whole_table():
    table = RotaryTable(base_rope(YARN), 32, CONTEXT, "cpu", torch.float32)
    table.at(torch.arange(300), 300)
    assert table.cos.shape[0] == RotaryTable.FIRST_ROWS < CONTEXT
