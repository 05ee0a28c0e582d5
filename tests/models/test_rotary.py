"""Rotary tables: rows read by position on the CPU equal the rows computed for those positions."""

from __future__ import annotations

import pytest
import torch

from sonar_core.layers.rotary import TABLE_MAX_POSITIONS, RopeConfig, RotaryEmbedding


def _config(head_dim: int, partial: float = 1.0, rope_type: str = "default") -> RopeConfig:
    return RopeConfig(head_dim=head_dim, theta=10_000.0, rope_type=rope_type, factor=8.0,
                      original_max_position_embeddings=8192, partial_rotary_factor=partial)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [_config(64), _config(128, rope_type="llama3"), _config(80), _config(64, 0.75)],
                         ids=["64", "128-llama3", "80", "64-partial"])
def test_table_rows_equal_computed_rows(config, dtype):
    rotary = RotaryEmbedding(config)
    # Decode-like single rows, a verification run, and positions that make the table grow twice.
    for positions in ([5], [700, 701, 702, 703], [3000], list(range(1990, 2010)), [0]):
        index = torch.tensor(positions)
        got = rotary.cos_sin(index, dtype)
        expected = rotary._compute(index, dtype)
        for table, computed in zip(got, expected, strict=True):
            assert table.shape == computed.shape == (len(positions), 1, config.rotary_dim)
            assert torch.equal(table, computed)


def test_positions_past_the_table_bound_are_computed():
    rotary = RotaryEmbedding(_config(64))
    far = torch.tensor([TABLE_MAX_POSITIONS + 10])
    cos, sin = rotary.cos_sin(far, torch.float32)
    assert not rotary._tables
    assert torch.equal(cos, rotary._compute(far, torch.float32)[0])


def test_a_known_bound_gives_the_same_rows_and_a_short_one_fails():
    """``upto`` (a bound the caller knows) only spares reading the largest position back."""
    rotary = RotaryEmbedding(_config(64))
    positions = torch.tensor([3, 1500, 700])
    for dtype in (torch.float32, torch.bfloat16):
        expected = rotary._compute(positions, dtype)
        for got, computed in zip(rotary.cos_sin(positions, dtype, upto=1501), expected, strict=True):
            assert torch.equal(got, computed)
    fresh = RotaryEmbedding(_config(64))
    with pytest.raises(IndexError):
        fresh.cos_sin(torch.tensor([5000]), torch.float32, upto=10)
