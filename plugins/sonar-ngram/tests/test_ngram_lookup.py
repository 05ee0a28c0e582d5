"""The host lookup (sonar_core.spec_decode.prompt_lookup) on hand-made cases and against the plain reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
from ngram_reference import reference_draft, repetitive_sequence

from sonar_core.spec_decode.prompt_lookup import TokenHistory, find_draft, find_match_end


def draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return find_draft(np.asarray(tokens, dtype=np.int32), min_n, max_n, k)[0].tolist()


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # Suffix [1, 2, 3]: the 3-gram occurs at 0..2 (followed by 10, 11); the 2-gram [2, 3] also
    # occurs later at 5..6 (followed by 20), which a shorter window would pick.
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 1, 2, 3]
    assert draft(tokens, 1, 3, 2) == [10, 11]
    assert draft(tokens, 1, 2, 2) == [20, 1]
    assert find_match_end(np.asarray(tokens, dtype=np.int32), 1, 3) == (2, 3)


def test_most_recent_occurrence_wins() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8]
    assert draft(tokens, 2, 2, 1) == [3]


def test_k_limits_and_the_copy_continues_past_the_end() -> None:
    tokens = [5, 6, 1, 2, 3, 4, 9, 5, 6]
    assert draft(tokens, 2, 2, 3) == [1, 2, 3]
    # Past the end the copy continues from itself: the sequence repeats with period 7.
    assert draft(tokens, 2, 2, 10) == [1, 2, 3, 4, 9, 5, 6, 1, 2, 3]
    # Periodic run: the most recent occurrence overlaps the pattern; the loop is drafted in full.
    assert draft([4, 5, 4, 5, 4, 5], 2, 2, 5) == [4, 5, 4, 5, 4]


def test_no_match_gives_an_empty_draft() -> None:
    assert draft([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert draft([1, 2, 3, 1, 2], 3, 4, 4) == []  # only a 2-gram recurs, below min_n


def test_bounds_limit_the_window_length() -> None:
    tokens = [1, 2, 3, 9, 0, 2, 3, 8, 1, 2, 3]
    assert draft(tokens, 3, 3, 1) == [9]
    assert draft(tokens, 1, 1, 1) == [8]
    assert draft(tokens, 4, 5, 1) == []


def test_match_at_the_very_start() -> None:
    assert draft([1, 2, 5, 6, 7, 1, 2], 2, 2, 3) == [5, 6, 7]


def test_short_sequences_and_zero_k() -> None:
    assert draft([], 1, 3, 2) == []
    assert draft([4], 1, 3, 2) == []
    assert draft([4, 4], 1, 3, 2) == [4, 4]
    assert draft([4, 4], 2, 3, 2) == []
    assert draft([1, 2, 1, 2], 1, 3, 0) == []


def test_agrees_with_the_reference_on_random_repetitive_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(600):
        tokens = repetitive_sequence(rng, rng.randint(0, 160))
        min_n = rng.randint(1, 5)
        max_n = rng.randint(min_n, 8)
        k = rng.randint(0, 9)
        assert draft(tokens, min_n, max_n, k) == reference_draft(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
            k,
        )


@pytest.mark.parametrize("steps", [[5, 1, 1, 3, 1, 2], [1, 1, 1, 1], [40, 7, 300, 1]])
def test_token_history_converts_only_new_tokens_and_grows(steps: list[int]) -> None:
    rng = random.Random(len(steps))
    tokens: list[int] = []
    history = TokenHistory(capacity=2)
    for num_new in steps:
        tokens.extend(rng.randrange(50) for _ in range(num_new))
        history.sync(tokens, num_new)
        assert history.view().tolist() == tokens


def test_token_history_refills_when_the_engine_reports_a_full_resend() -> None:
    history = TokenHistory()
    history.sync([1, 2, 3], 3)
    # A recomputed request: everything is new again, and the old contents must not survive.
    history.sync([9, 8, 7, 6], 4)
    assert history.view().tolist() == [9, 8, 7, 6]
    # A buffer that missed a step (fewer tokens than the engine assumes) fills the gap.
    history.sync([9, 8, 7, 6, 5, 4], 1)
    assert history.view().tolist() == [9, 8, 7, 6, 5, 4]
