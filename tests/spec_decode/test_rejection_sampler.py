"""Rejection sampler (torch reference): unit cases and statistical losslessness.

Statistical checks use the distribution-free bound of Weissman et al. (2003): for n i.i.d.
samples over K categories, P(||p_hat - p||_1 >= eps) <= (2^K - 2) exp(-n eps^2 / 2). With
eps = sqrt(2 (ln(2^K - 2) + ln(1/delta)) / n) a correct sampler fails a check with probability at
most delta = 1e-6. The seeds are fixed, so the tests are deterministic; the bound says how
unlikely a failure of a correct sampler would be for any seed. A wrong sampler whose output
distribution is at L1 distance d >= 2 eps from p fails the same check with probability at least
1 - delta, and the tests assert that margin before relying on it.
"""

import math

import pytest
import torch

from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import Sampler, make_generator
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode import rejection_sampler
from sonar_core.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    SpecDecodeMetadata,
    draw_acceptance_uniforms,
    rejection_sample,
    rejection_verify_torch,
)

GREEDY = SamplingParams(temperature=0.0)
DELTA = 1e-6


def l1_bound(num_samples: int, num_categories: int, false_positive_rate: float = DELTA) -> float:
    return math.sqrt(2.0 * (math.log(2.0**num_categories - 2.0) - math.log(false_positive_rate)) / num_samples)


def empirical(tokens: torch.Tensor, num_categories: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=num_categories).double() / tokens.numel()


def batch_of(params: list[SamplingParams], generators: list[torch.Generator | None] | None = None) -> SamplingBatch:
    return SamplingBatch.from_params(params, generators or [None] * len(params), "cpu")


def one_hot_logits(argmaxes: list[int], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# ---------------------------------------------------------------------------------------------
# Layout and unit cases


def test_metadata_layout() -> None:
    meta = SpecDecodeMetadata.from_drafts([[5, 6], [], [7, 8, 9]], "cpu")
    assert meta.draft_token_ids.tolist() == [5, 6, 7, 8, 9]
    assert meta.num_draft_tokens == [2, 0, 3]
    assert meta.cu_num_draft_tokens.tolist() == [2, 2, 5]
    # Rows: request 0 -> 0, 1 (+ bonus 2); request 1 -> bonus 3; request 2 -> 4, 5, 6 (+ bonus 7).
    assert meta.target_logits_indices.tolist() == [0, 1, 4, 5, 6]
    assert meta.bonus_logits_indices.tolist() == [2, 3, 7]
    assert meta.max_spec_len == 3


def test_greedy_all_accepted_emits_the_bonus() -> None:
    meta = SpecDecodeMetadata.from_drafts([[3, 1, 4]], "cpu")
    logits = one_hot_logits([3, 1, 4, 9], vocab=10)
    out = rejection_sample(logits, meta, None, batch_of([GREEDY]))
    assert out.output_token_ids == [[3, 1, 4, 9]]
    assert out.num_accepted == [3]


def test_greedy_first_rejected_emits_the_target_argmax() -> None:
    meta = SpecDecodeMetadata.from_drafts([[2, 1, 4]], "cpu")
    logits = one_hot_logits([3, 1, 4, 9], vocab=10)
    out = rejection_sample(logits, meta, None, batch_of([GREEDY]))
    assert out.output_token_ids == [[3]]
    assert out.num_accepted == [0]


def test_greedy_ties_resolve_to_the_lowest_index() -> None:
    # Tokens 2 and 5 tie for the maximum: only 2 counts as the argmax, so draft 5 is rejected.
    logits = torch.zeros(2, 8)
    logits[0, [2, 5]] = 3.0
    logits[1, 0] = 1.0
    out = rejection_sample(logits, SpecDecodeMetadata.from_drafts([[5]], "cpu"), None, batch_of([GREEDY]))
    assert out.output_token_ids == [[2]]
    out = rejection_sample(logits, SpecDecodeMetadata.from_drafts([[2]], "cpu"), None, batch_of([GREEDY]))
    assert out.output_token_ids == [[2, 0]]


def test_greedy_with_draft_probs_is_still_argmax_verification() -> None:
    torch.manual_seed(0)
    logits = one_hot_logits([3, 1, 4], vocab=6)
    draft_probs = torch.softmax(torch.randn(2, 6), dim=-1)
    for drafts, expected in (([3, 1], [3, 1, 4]), ([3, 2], [3, 1]), ([0, 1], [3])):
        meta = SpecDecodeMetadata.from_drafts([drafts], "cpu")
        assert rejection_sample(logits, meta, draft_probs, batch_of([GREEDY])).output_token_ids == [expected]


def test_mixed_batch_with_different_draft_lengths() -> None:
    torch.manual_seed(0)
    vocab = 12
    drafts = [[1, 2, 3], [], [4, 5], [6], []]
    # Request 0 (greedy): rows argmax 1, 2, 7 -> accepts 1, 2, rejects 3, recovers 7.
    # Request 1 (greedy, no drafts): bonus row argmax 8.
    # Request 2 (random): draft probs equal to the target probs -> always accepted, then a bonus
    # token from the support of its bonus row (tokens 0 and 11).
    # Request 3 (random, one-hot draft): the draft has probability 0 under top_k -> rejected.
    # Request 4 (random, no drafts): one token from its row's top-2.
    rows = torch.randn(4 + 1 + 3 + 2 + 1, vocab)  # k_i + 1 rows per request
    rows[0:4] = one_hot_logits([1, 2, 7, 0], vocab)
    rows[4] = one_hot_logits([8], vocab)[0]
    rows[5, 4], rows[6, 5], rows[7, [0, 11]] = 6.0, 6.0, 9.0
    rows[8, 6] = -9.0
    params = [GREEDY, GREEDY, SamplingParams(top_k=2), SamplingParams(top_k=3), SamplingParams(top_k=2)]
    batch = batch_of(params)
    meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
    target = processed_probs(rows, batch.repeat_rows([k + 1 for k in meta.num_draft_tokens]))
    draft_probs = torch.nn.functional.one_hot(meta.draft_token_ids, vocab).float()
    draft_probs[3:5] = target[5:7]  # request 2's draft rows
    out = rejection_sample(rows, meta, draft_probs, batch)
    assert out.num_accepted == [2, 0, 2, 0, 0]
    assert out.output_token_ids[0] == [1, 2, 7]
    assert out.output_token_ids[1] == [8]
    assert out.output_token_ids[2][:2] == [4, 5] and out.output_token_ids[2][2] in (0, 11)
    assert len(out.output_token_ids[3]) == 1 and target[8, out.output_token_ids[3][0]] > 0
    assert out.output_token_ids[3][0] != 6
    assert len(out.output_token_ids[4]) == 1 and target[10, out.output_token_ids[4][0]] > 0


def test_random_all_accepted_when_draft_equals_target() -> None:
    torch.manual_seed(3)
    vocab, k, requests = 20, 4, 64
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * requests
    batch = batch_of(params)
    logits = torch.randn(requests * (k + 1), vocab)
    target = processed_probs(logits, batch.repeat_rows([k + 1] * requests))
    drafts = torch.multinomial(target, 1).squeeze(1).view(requests, k + 1)[:, :k]
    meta = SpecDecodeMetadata.from_drafts(drafts.tolist(), "cpu")
    draft_probs = target[meta.target_logits_indices]
    out = rejection_sample(logits, meta, draft_probs, batch)
    assert out.num_accepted == [k] * requests
    for i, tokens in enumerate(out.output_token_ids):
        assert tokens[:k] == drafts[i].tolist()
        assert target[meta.bonus_logits_indices[i], tokens[k]] > 0


def test_request_without_drafts_samples_like_the_plain_sampler() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 500)
    params = [SamplingParams(temperature=0.9, seed=11), GREEDY, SamplingParams(top_k=50, seed=12)]

    def generators() -> list[torch.Generator | None]:
        return [make_generator(11, "cpu"), None, make_generator(12, "cpu")]

    meta = SpecDecodeMetadata.from_drafts([[], [], []], "cpu")
    verified = rejection_sample(logits, meta, None, batch_of(params, generators()))
    plain = Sampler()(logits, batch_of(params, generators()))
    assert verified.output_token_ids == [[t] for t in plain.token_ids.tolist()]
    assert verified.num_accepted == [0, 0, 0]


def test_seeded_request_consumes_uniforms_then_race_weights() -> None:
    meta = SpecDecodeMetadata.from_drafts([[1, 2], [3, 4, 5]], "cpu")
    batch = batch_of([SamplingParams(), SamplingParams(seed=9)], [None, make_generator(9, "cpu")])
    uniforms = draw_acceptance_uniforms(batch, meta, "cpu")
    reference = make_generator(9, "cpu")
    assert torch.equal(uniforms[2:], torch.rand(3, generator=reference))
    greedy = batch_of([GREEDY, GREEDY])
    assert draw_acceptance_uniforms(greedy, meta, "cpu").eq(0.0).all()


def test_seeded_request_ignores_its_neighbours() -> None:
    torch.manual_seed(0)
    vocab = 300
    own_logits = torch.randn(4, vocab)
    own_drafts = torch.softmax(own_logits[:3], dim=-1).argmax(dim=-1).tolist()  # likely accepted early
    own_params = SamplingParams(temperature=1.0, seed=42)

    def run(neighbours: int, default_seed: int) -> tuple[list[int], int]:
        torch.manual_seed(default_seed)
        drafts, rows, params, generators = [], [], [], []
        for i in range(neighbours):
            k = i % 3
            drafts.append(torch.randint(0, vocab, (k,)).tolist())
            rows.append(torch.randn(k + 1, vocab))
            params.append(GREEDY if i % 2 else SamplingParams(temperature=0.7, seed=i))
            generators.append(None if i % 2 else make_generator(i, "cpu"))
        drafts.insert(neighbours // 2, own_drafts)
        rows.insert(neighbours // 2, own_logits)
        params.insert(neighbours // 2, own_params)
        generators.insert(neighbours // 2, make_generator(42, "cpu"))
        meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
        draft_probs = torch.softmax(torch.randn(meta.total_draft_tokens, vocab), dim=-1)
        draft_probs[meta.cu_num_draft_tokens[neighbours // 2] - 3 : meta.cu_num_draft_tokens[neighbours // 2]] = (
            torch.softmax(own_logits[:3] * 0.5, dim=-1)
        )
        out = rejection_sample(torch.cat(rows), meta, draft_probs, batch_of(params, generators))
        return out.output_token_ids[neighbours // 2], out.num_accepted[neighbours // 2]

    results = [run(n, s) for n, s in [(0, 0), (1, 1), (4, 2), (9, 3)]]
    assert all(r == results[0] for r in results)


def test_rejects_inconsistent_inputs() -> None:
    meta = SpecDecodeMetadata.from_drafts([[1, 2], []], "cpu")
    batch = batch_of([GREEDY, GREEDY])
    with pytest.raises(ValueError, match="draft rows"):
        rejection_sample(torch.zeros(3, 5), meta, None, batch)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(4, 5), meta, torch.zeros(3, 5), batch)
    with pytest.raises(ValueError, match="rows for 2 requests"):
        rejection_sample(torch.zeros(4, 5), meta, None, batch_of([GREEDY]))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        rejection_sample(torch.zeros(4, 2), meta, None, batch)
    with pytest.raises(ValueError, match="unknown rejection sampler backend"):
        rejection_sample(torch.zeros(4, 5), meta, None, batch, backend="cuda")


def test_empty_batch() -> None:
    out = rejection_sample(torch.zeros(0, 5), SpecDecodeMetadata.from_drafts([], "cpu"), None, batch_of([]))
    assert out.output_token_ids == [] and out.num_accepted == []


def test_reference_output_matrix_is_padded_with_the_placeholder() -> None:
    meta = SpecDecodeMetadata.from_drafts([[1, 2, 3], [4]], "cpu")
    probs = torch.nn.functional.one_hot(torch.tensor([1, 0, 3, 3, 4, 2]), 6).float()
    tokens, accepted = rejection_verify_torch(probs, meta, None, torch.zeros(4), torch.ones(2, 6))
    assert accepted.tolist() == [1, 1]
    assert tokens.tolist() == [[1, 0, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID], [4, 2, -1, -1]]


# ---------------------------------------------------------------------------------------------
# Statistical losslessness


VOCAB = 8
NUM_REQUESTS = 50_000


def _random_dist(generator: torch.Generator, *shape: int, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, VOCAB, generator=generator, dtype=torch.float64) * scale, dim=-1)


def _two_step_problem(seed: int):
    """Target p1, P2[x1], p3 and draft q1, Q2[x1] over 8 tokens; drafts sampled from the draft.

    Position 2's distributions depend on the first draft (the context), as in a real model.
    """
    g = torch.Generator().manual_seed(seed)
    p1, p2_table, p3 = _random_dist(g), _random_dist(g, VOCAB), _random_dist(g)
    q1, q2_table = _random_dist(g), _random_dist(g, VOCAB)
    d1 = torch.multinomial(q1.float(), NUM_REQUESTS, replacement=True, generator=g)
    d2 = torch.multinomial(q2_table[d1].float(), 1, generator=g).squeeze(1)
    # Rows per request: position 1, position 2 (given d1), bonus.
    target = torch.stack([p1.expand(NUM_REQUESTS, VOCAB), p2_table[d1], p3.expand(NUM_REQUESTS, VOCAB)], dim=1)
    draft = torch.stack([q1.expand(NUM_REQUESTS, VOCAB), q2_table[d1]], dim=1)
    return p1, p2_table, p3, q1, torch.stack([d1, d2], dim=1), target, draft


def _run(drafts: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None, params: SamplingParams):
    meta = SpecDecodeMetadata.from_drafts(drafts.tolist(), "cpu")
    logits = target.log().float().reshape(-1, VOCAB)
    draft_probs = None if draft is None else draft.float().reshape(-1, VOCAB)
    out = rejection_sample(logits, meta, draft_probs, batch_of([params] * drafts.shape[0]))
    padded = torch.full((drafts.shape[0], 3), -1, dtype=torch.int64)
    for i, tokens in enumerate(out.output_token_ids):
        padded[i, : len(tokens)] = torch.tensor(tokens)
    return padded, torch.tensor(out.num_accepted)


def _check_lossless(tokens: torch.Tensor, accepted: torch.Tensor, p1, p2_table, p3, q1) -> dict[str, tuple[float, float]]:
    """L1 distance and bound of each checked distribution, by name."""
    results: dict[str, tuple[float, float]] = {}
    # First output token: p1, whatever happened.
    results["first"] = (float((empirical(tokens[:, 0], VOCAB) - p1).abs().sum()), l1_bound(len(tokens), VOCAB))
    # Second output token, given the first draft x1 was accepted: (x1, x2) has the joint
    # min(p1, q1)(x1) / beta * P2[x1](x2), beta = sum min(p1, q1) (acceptance probability).
    first_accepted = accepted >= 1
    joint = min_p1_q1 = torch.minimum(p1, q1)
    joint = (min_p1_q1 / min_p1_q1.sum()).unsqueeze(1) * p2_table
    pairs = tokens[first_accepted, 0] * VOCAB + tokens[first_accepted, 1]
    n = int(first_accepted.sum())
    results["second"] = (
        float((empirical(pairs, VOCAB * VOCAB) - joint.reshape(-1)).abs().sum()),
        l1_bound(n, VOCAB * VOCAB),
    )
    # Bonus token when both drafts were accepted: p3.
    both = accepted == 2
    results["bonus"] = (float((empirical(tokens[both, 2], VOCAB) - p3).abs().sum()), l1_bound(int(both.sum()), VOCAB))
    return results


def _assert_all_within(results: dict[str, tuple[float, float]]) -> None:
    for name, (distance, bound) in results.items():
        assert distance < bound, f"{name} token: L1 {distance:.4f} >= bound {bound:.4f}"


def test_output_follows_target_with_draft_probs() -> None:
    torch.manual_seed(2024)
    p1, p2_table, p3, q1, drafts, target, draft = _two_step_problem(seed=1)
    tokens, accepted = _run(drafts, target, draft, SamplingParams(temperature=1.0))
    # Enough of each acceptance pattern for the conditional checks to be meaningful.
    assert (accepted >= 1).sum() > NUM_REQUESTS // 4 and (accepted == 2).sum() > NUM_REQUESTS // 10
    _assert_all_within(_check_lossless(tokens, accepted, p1, p2_table, p3, q1))


def test_one_hot_verification_of_sampled_drafts_is_lossless() -> None:
    """Drafts drawn from q but verified as one-hot (no draft probs) still give p: accepting x with
    probability p(x) and recovering from p without x sums to q(y) p(y) + p(y) (1 - q(y)) = p(y)."""
    torch.manual_seed(7)
    p1, p2_table, p3, _, drafts, target, _ = _two_step_problem(seed=2)
    tokens, accepted = _run(drafts, target, None, SamplingParams(temperature=1.0))
    first = (float((empirical(tokens[:, 0], VOCAB) - p1).abs().sum()), l1_bound(NUM_REQUESTS, VOCAB))
    _assert_all_within({"first": first})


@pytest.mark.parametrize(
    ("wrong_residual", "wrong_first_token"),
    [
        # Recovering from p instead of the residual: min(p, q) + (1 - beta) p.
        (lambda p, q: p, lambda p, q: torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p),
        # |p - q| instead of max(p - q, 0) (a residual "without the max"): min(p, q) + |p - q| / 2.
        # A plain p - q would go unnoticed here: the exponential race never picks a negative weight.
        (lambda p, q: (p - q).abs(), lambda p, q: torch.minimum(p, q) + (p - q).abs() / 2),
    ],
    ids=["recover-from-p", "residual-abs"],
)
def test_the_check_fails_for_a_wrong_sampler(monkeypatch: pytest.MonkeyPatch, wrong_residual, wrong_first_token) -> None:
    torch.manual_seed(2024)
    p1, p2_table, p3, q1, drafts, target, draft = _two_step_problem(seed=1)
    bound = l1_bound(NUM_REQUESTS, VOCAB)
    # The wrong sampler's exact first-token distribution is far enough from p1 to be caught with
    # probability >= 1 - delta.
    assert float((wrong_first_token(p1, q1) - p1).abs().sum()) > 2 * bound
    monkeypatch.setattr(rejection_sampler, "residual_distribution", wrong_residual)
    tokens, accepted = _run(drafts, target, draft, SamplingParams(temperature=1.0))
    distance, bound = _check_lossless(tokens, accepted, p1, p2_table, p3, q1)["first"]
    assert distance >= bound


def test_output_follows_processed_probs_with_temperature_and_top_k() -> None:
    """temperature 0.7 + top_k 4: the first token follows processed_probs, never outside top-k."""
    torch.manual_seed(99)
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.7, top_k=4)
    logits1 = torch.randn(VOCAB, generator=g) * 1.5
    expected = processed_probs(logits1.unsqueeze(0), batch_of([params]))[0].double()
    q1 = _random_dist(g)
    d1 = torch.multinomial(q1.float(), NUM_REQUESTS, replacement=True, generator=g)
    meta = SpecDecodeMetadata.from_drafts(d1.unsqueeze(1).tolist(), "cpu")
    logits = torch.stack([logits1.expand(NUM_REQUESTS, VOCAB), torch.randn(NUM_REQUESTS, VOCAB, generator=g)], dim=1)
    out = rejection_sample(
        logits.reshape(-1, VOCAB), meta, q1.float().expand(NUM_REQUESTS, VOCAB), batch_of([params] * NUM_REQUESTS)
    )
    first = torch.tensor([tokens[0] for tokens in out.output_token_ids])
    freq = empirical(first, VOCAB)
    assert freq[expected == 0].sum() == 0.0
    assert float((freq - expected).abs().sum()) < l1_bound(NUM_REQUESTS, VOCAB)


def test_greedy_fast_path_equals_the_general_walk() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 50
    counts = [3, 0, 5, 1, 4]
    logits = torch.randn(sum(counts) + len(counts), vocab, generator=generator)
    top = logits.argmax(dim=-1).tolist()
    drafts, row = [], 0
    for k in counts:
        # Drafts that follow the argmax for a while, then diverge.
        keep = torch.randint(0, k + 1, (1,), generator=generator).item()
        drafts.append([top[row + j] if j < keep else (top[row + j] + 1) % vocab for j in range(k)])
        row += k + 1
    metadata = SpecDecodeMetadata.from_drafts(drafts, "cpu")
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * len(counts), [None] * len(counts), "cpu")
    fast = rejection_sample(logits, metadata, None, sampling, backend="torch")
    probs = processed_probs(logits, sampling.repeat_rows([k + 1 for k in counts]))
    uniforms = torch.zeros(metadata.total_draft_tokens)
    out, accepted = rejection_sampler.rejection_verify_torch(probs, metadata, None, uniforms, torch.ones(len(counts), vocab))
    assert fast.num_accepted == accepted.tolist()
    assert fast.output_token_ids == [r[: a + 1] for r, a in zip(out.tolist(), accepted.tolist(), strict=True)]
