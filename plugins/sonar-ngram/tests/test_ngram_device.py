"""The batched device lookup (sonar_ngram.lookup_device) must draft exactly what the host lookup drafts,
and report the same matched n-gram lengths."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from ngram_reference import reference_draft, repetitive_sequence
from sonar_ngram.lookup_device import DeviceTokenSlots, batch_find_drafts

from sonar_core.spec_decode.prompt_lookup import find_match_end


def run_batch(
    sequences: list[list[int]], limits: list[int], min_n: int, max_n: int, k: int, device: str = "cpu"
) -> list[list[int]]:
    """Pad with junk (as a reused slot would hold) and read the drafts back as lists."""
    width = max([len(s) for s in sequences] + [1]) + 3
    tokens = torch.randint(0, 4, (len(sequences), width), dtype=torch.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.int32)
    lengths = torch.tensor([len(s) for s in sequences])
    drafts, counts, match_lengths = batch_find_drafts(
        tokens.to(device), lengths.to(device), torch.tensor(limits).to(device), min_n, max_n, k
    )
    assert drafts.shape == (len(sequences), k)
    for sequence, count, match_length in zip(sequences, counts.tolist(), match_lengths.tolist(), strict=True):
        host_length = find_match_end(np.asarray(sequence, dtype=np.int32), min_n, max_n)[1]
        assert match_length == (host_length if count else 0)
    return [row[:count] for row, count in zip(drafts.tolist(), counts.tolist(), strict=True)]


def test_hand_made_cases() -> None:
    sequences = [
        [1, 2, 3, 10, 11, 2, 3, 20, 1, 2, 3],  # longest n wins
        [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8],  # most recent occurrence
        [1, 2, 5, 6, 7, 1, 2],  # match at the very start
        [4, 5, 4, 5, 4, 5],  # the copy continues past the end
        [1, 2, 3, 4, 5],  # no match
        [],
        [4],
        [4, 4],
    ]
    assert run_batch(sequences, [2, 1, 3, 4, 4, 4, 4, 4], 1, 3, 4) == [
        [10, 11],
        [3],
        [5, 6, 7],
        [4, 5, 4, 5],
        [],
        [],
        [],
        [4, 4, 4, 4],
    ]


def test_per_row_limits_including_zero() -> None:
    sequences = [[1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 1, 2]]
    assert run_batch(sequences, [0, 1, 5], 2, 2, 5) == [[], [3], [3, 4, 1, 2, 3]]


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_the_reference_on_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        min_n = rng.randint(1, 5)
        max_n = rng.randint(min_n, 8)
        k = rng.randint(1, 9)
        sequences = [repetitive_sequence(rng, rng.randint(0, 120)) for _ in range(rng.randint(1, 8))]
        limits = [rng.randint(0, k) for _ in sequences]
        expected = [
            reference_draft(s, min_n, max_n, limit) for s, limit in zip(sequences, limits, strict=True)
        ]
        assert run_batch(sequences, limits, min_n, max_n, k) == expected


def test_slots_grow_in_rows_and_width_and_keep_their_contents() -> None:
    slots = DeviceTokenSlots(torch.device("cpu"), max_len=64, rows=1, width=2)
    first = slots.reserve("a", 2)
    flat = torch.tensor([first * 2, first * 2 + 1])
    slots.write(flat, torch.tensor([7, 8]))
    second = slots.reserve("b", 5)  # a second row and a wider tensor
    assert second != first and slots.tokens.shape[0] >= 2 and slots.tokens.shape[1] >= 5
    assert slots.tokens[first, :2].tolist() == [7, 8]
    assert slots.length("a") == 2 and slots.length("b") == 5
    slots.release("a")
    assert slots.length("a") == 0
    assert slots.slot("c") == first  # a released row is reused


@pytest.mark.gpu
def test_cuda_agrees_with_the_reference() -> None:
    rng = random.Random(99)
    for _ in range(50):
        sequences = [repetitive_sequence(rng, rng.randint(0, 300)) for _ in range(16)]
        limits = [rng.randint(0, 6) for _ in sequences]
        expected = [reference_draft(s, 1, 5, limit) for s, limit in zip(sequences, limits, strict=True)]
        assert run_batch(sequences, limits, 1, 5, 6, device="cuda") == expected
