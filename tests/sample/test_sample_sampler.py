"""The plain sampler: greedy rows, per-request generators, and the sampled distribution."""

import math

import torch

from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import Sampler, draw_race_weights, make_generator
from sonar_core.sampling_params import SamplingParams


def l1_bound(num_samples: int, num_categories: int, false_positive_rate: float) -> float:
    """epsilon with P(||empirical - p||_1 >= epsilon) <= false_positive_rate.

    Weissman et al. (2003): P(||p_hat - p||_1 >= eps) <= (2^K - 2) exp(-n eps^2 / 2) for n i.i.d.
    samples over K categories, whatever p is.
    """
    return math.sqrt(2.0 * (math.log(2.0**num_categories - 2.0) - math.log(false_positive_rate)) / num_samples)


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [7.0, 7.0, 7.0, 7.0], [-1.0, -2.0, -0.5, -3.0]])
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 3, [None] * 3, "cpu")
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == [1, 0, 2]
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_still_take_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(top_k=5) for i in range(6)]
    out = Sampler()(logits, SamplingBatch.from_params(params, [None] * 6, "cpu"))
    assert out.token_ids[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()


def test_logprobs_are_raw_log_softmax_of_the_sampled_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.5, top_k=3)] * 4
    out = Sampler()(logits, SamplingBatch.from_params(params, [None] * 4, "cpu"), want_logprobs=True)
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(4), out.token_ids]
    torch.testing.assert_close(out.logprobs, expected)


def test_seeded_row_ignores_its_neighbours() -> None:
    torch.manual_seed(0)
    vocab = 1000
    target = torch.randn(1, vocab)
    seeded = SamplingParams(temperature=1.0, seed=7)

    def sample_with(neighbours: int, default_seed: int) -> int:
        torch.manual_seed(default_seed)
        logits = torch.cat([torch.randn(neighbours, vocab), target, torch.randn(neighbours, vocab)])
        params = [SamplingParams(temperature=0.9)] * neighbours + [seeded] + [SamplingParams(temperature=0.0)] * neighbours
        generators = [None] * neighbours + [make_generator(7, "cpu")] + [None] * neighbours
        out = Sampler()(logits, SamplingBatch.from_params(params, generators, "cpu"))
        return int(out.token_ids[neighbours])

    results = {sample_with(n, s) for n, s in [(0, 0), (1, 1), (5, 2), (17, 3)]}
    assert len(results) == 1


def test_seeded_row_draws_only_from_its_generator() -> None:
    batch = SamplingBatch.from_params(
        [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams()],
        [None, None, make_generator(3, "cpu")],
        "cpu",
    )
    weights = draw_race_weights(batch, 16, "cpu")
    expected = 1.0 / torch.empty(16).exponential_(generator=make_generator(3, "cpu"))
    torch.testing.assert_close(weights[2], expected)
    assert weights[1].eq(1.0).all()  # greedy rows: no noise


def test_distribution_matches_processed_probs() -> None:
    """Temperature 0.7 + top_k: the empirical distribution equals processed_probs.

    20000 rows over 8 tokens; the L1 bound at false-positive rate 1e-6 is about 0.044.
    """
    torch.manual_seed(1234)
    vocab, rows = 8, 20000
    logits = torch.randn(1, vocab) * 1.5
    params = SamplingParams(temperature=0.7, top_k=4)
    batch = SamplingBatch.from_params([params] * rows, [None] * rows, "cpu")
    tokens = Sampler()(logits.expand(rows, vocab), batch).token_ids
    expected = processed_probs(logits, SamplingBatch.from_params([params], [None], "cpu"))[0]
    # processed_probs itself: softmax(logits / 0.7) over the four largest logits.
    keep = logits[0].topk(4).indices
    by_hand = torch.zeros(vocab)
    by_hand[keep] = torch.softmax(logits[0, keep] / 0.7, dim=-1)
    torch.testing.assert_close(expected, by_hand)
    empirical = torch.bincount(tokens, minlength=vocab).double() / rows
    assert empirical[expected == 0].sum() == 0.0
    assert (empirical - expected.double()).abs().sum() < l1_bound(rows, vocab, 1e-6)


def test_top_p_and_min_p_never_sample_outside_the_kept_set() -> None:
    torch.manual_seed(5)
    vocab, rows = 64, 4000
    logits = torch.randn(1, vocab) * 2
    for params in (SamplingParams(top_p=0.5), SamplingParams(min_p=0.2), SamplingParams(top_k=10, top_p=0.9)):
        batch = SamplingBatch.from_params([params] * rows, [None] * rows, "cpu")
        tokens = Sampler()(logits.expand(rows, vocab), batch).token_ids
        support = processed_probs(logits, SamplingBatch.from_params([params], [None], "cpu"))[0] > 0
        assert support[tokens].all()
        assert support.sum() < vocab
