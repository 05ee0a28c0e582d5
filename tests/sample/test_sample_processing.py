"""The target distribution: temperature, top-k, top-p, min-p against hand-computed values."""

import math

import pytest
import torch

from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sampling_params import SamplingParams


def _batch(*params: SamplingParams) -> SamplingBatch:
    return SamplingBatch.from_params(list(params), [None] * len(params), "cpu")


def _logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


# Probabilities 0.5, 0.3, 0.15, 0.05 in shuffled token order, so masks must map back correctly.
PROBS = [0.15, 0.5, 0.05, 0.3]


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    got = processed_probs(logits, _batch(SamplingParams(temperature=0.7)))
    torch.testing.assert_close(got, torch.softmax(logits / 0.7, dim=-1))


def test_top_k_keeps_the_k_largest() -> None:
    got = processed_probs(_logits_for(PROBS), _batch(SamplingParams(top_k=2)))
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]]))


def test_top_k_keeps_values_tied_with_the_kth() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    got = processed_probs(logits, _batch(SamplingParams(top_k=2)))
    assert (got[0, :3] > 0).all() and got[0, 3] == 0.0


def test_top_k_at_or_above_vocab_size_is_off() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    expected = torch.softmax(logits, dim=-1)
    for k in (4, 9):
        torch.testing.assert_close(processed_probs(logits, _batch(SamplingParams(top_k=k))), expected)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        # Ascending cumulative mass 0.05, 0.20, 0.50, 1.0: a token goes when the mass up to it is <= 1 - top_p.
        (0.75, [1, 3]),
        (0.85, [0, 1, 3]),
        (0.01, [1]),  # the most likely token always stays
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_nucleus(top_p: float, kept: list[int]) -> None:
    got = processed_probs(_logits_for(PROBS), _batch(SamplingParams(top_p=top_p)))
    mass = sum(PROBS[i] for i in kept)
    expected = torch.tensor([[PROBS[i] / mass if i in kept else 0.0 for i in range(4)]])
    torch.testing.assert_close(got, expected)


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    # Threshold 0.2 * 0.5 = 0.1 removes only the 0.05 token.
    got = processed_probs(_logits_for(PROBS), _batch(SamplingParams(min_p=0.2)))
    torch.testing.assert_close(got, torch.tensor([[0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]]))


def test_order_is_temperature_top_k_top_p_min_p() -> None:
    # top_k=3 leaves 0.5, 0.3, 0.15 (renormalised .526, .316, .158); top_p=0.8 then drops .158
    # (mass <= 0.2); min_p=0.7 finally drops .375 of the renormalised pair (< 0.7 * .625).
    got = processed_probs(_logits_for(PROBS), _batch(SamplingParams(top_k=3, top_p=0.8)))
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    got = processed_probs(_logits_for(PROBS), _batch(SamplingParams(top_k=3, top_p=0.8, min_p=0.7)))
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_temperature_applies_before_the_filters() -> None:
    logits = _logits_for(PROBS)
    got = processed_probs(logits, _batch(SamplingParams(temperature=0.5, top_k=2)))
    scaled = torch.tensor([PROBS[1] ** 2, PROBS[3] ** 2])  # softmax(log p / 0.5) is proportional to p^2
    scaled = scaled / scaled.sum()
    torch.testing.assert_close(got, torch.tensor([[0.0, float(scaled[0]), 0.0, float(scaled[1])]]))


def test_greedy_rows_are_one_hot_at_the_lowest_tied_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [2.0, 1.0, 0.0, -1.0]])
    for batch in (
        _batch(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)),
        _batch(SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7)),  # below 1e-5: greedy
    ):
        assert batch.all_greedy
        got = processed_probs(logits, batch)
        torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_mixed_batch_rows_are_independent() -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=0.6, top_k=7, top_p=0.9, min_p=0.05),
    ]
    logits = torch.randn(len(params), 40) * 2
    together = processed_probs(logits, _batch(*params))
    for row, param in enumerate(params):
        alone = processed_probs(logits[row : row + 1], _batch(param))
        torch.testing.assert_close(together[row : row + 1], alone)
    torch.testing.assert_close(together.sum(dim=-1), torch.ones(len(params)))


def test_batch_flags_and_repeat_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.0), SamplingParams(top_k=-1, top_p=0.5)], [None, generator], "cpu"
    )
    assert not batch.all_greedy and not batch.all_random
    assert batch.top_k.tolist() == [0, 0]
    repeated = batch.repeat_rows([2, 3])
    assert repeated.temperature.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert repeated.top_p.tolist() == [1.0, 1.0, 0.5, 0.5, 0.5]
    assert repeated.generators == [None, None, generator, generator, generator]
    with pytest.raises(ValueError, match="repeat counts"):
        batch.repeat_rows([1])
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.from_params([SamplingParams()], [], "cpu")
