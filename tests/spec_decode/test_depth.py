import logging

import pytest

from sonar_core.spec_decode.depth import WARMUP_STEPS, AdaptiveDepth


def _policy(c0: float, c1: float, c2: float, max_depth: int = 5) -> AdaptiveDepth:
    """A policy whose cost model has seen steps that follow c0 + c1*T + c2*D exactly."""
    policy = AdaptiveDepth(max_depth)
    for target_tokens, drafted in [(1, 0), (5, 4), (16, 0), (40, 24), (3, 2), (64, 48), (8, 1), (2, 2), (30, 7)]:
        policy.observe_step(target_tokens, drafted, c0 + c1 * target_tokens + c2 * drafted, c2 * drafted)
    return policy


def _train(policy: AdaptiveDepth, request_id: str, rate: float, rounds: int = 200) -> None:
    """Feed verifications in which every position is accepted with probability `rate`."""
    for i in range(rounds):
        accepted = 0
        while accepted < policy.max_depth and ((i * 7919 + accepted * 104729) % 1000) / 1000 < rate:
            accepted += 1
        policy.observe_verification(request_id, policy.max_depth, accepted)


def test_warm_up_drafts_the_maximum_on_every_other_step():
    policy = AdaptiveDepth(max_depth=4)
    chosen = []
    for _ in range(WARMUP_STEPS):
        chosen.append(policy.choose(["a", "b"], [4, 2]))
        policy.observe_step(1, 0, 0.05, 0.0)
    assert chosen == [[4, 2], [0, 0]] * (WARMUP_STEPS // 2)


def test_costs_are_told_apart_when_drafts_and_verified_tokens_move_together():
    # At batch 1 a request that verified d drafts and drafts d again makes every step's target
    # tokens one more than its drafts: in one fit over both counts the split between them would
    # be arbitrary. The proposer's time is measured apart, so each cost has its own fit.
    policy = AdaptiveDepth(max_depth=5)
    for depth in [5, 5, 0, 3, 3, 5, 1, 0, 4, 5, 2, 5]:
        target = 0.010 + 0.002 * (1 + depth)
        propose = 0.0005 + 0.0003 * depth
        policy.observe_step(1 + depth, depth, target + propose, propose)
    assert policy.costs.coefficients() == pytest.approx((0.0105, 0.002, 0.0003), rel=1e-3)


def test_rates_are_learned_per_source():
    policy = _policy(c0=0.02, c1=0.002, c2=0.0)
    for i in range(200):
        policy.observe_verification(f"long{i}", 5, 5, source=5)
        policy.observe_verification(f"short{i}", 5, 0, source=2)
    # A request seen for the first time starts from its source's rates, not from the mixture's.
    long_match, short_match = policy.choose(["new1", "new2"], [5, 5], sources=[5, 2])
    assert (long_match, short_match) == (5, 0)
    assert policy.acceptance("new1", 5)[0] > 0.9 > 0.1 > policy.acceptance("new2", 2)[0]


@pytest.mark.parametrize(
    ("emitted", "reached", "accepted"),
    [
        ([7, 8, 0], [1, 1, 1, 0], [1, 1, 0, 0]),  # a mismatch at the third position
        ([7, 8], [1, 1, 0, 0], [1, 1, 0, 0]),  # all that was emitted matched: later positions unknown
        ([7, 8, 9, 6, 5], [1, 1, 1, 1], [1, 1, 1, 1]),  # the whole draft matched
        ([0], [1, 0, 0, 0], [0, 0, 0, 0]),
        ([], [0, 0, 0, 0], [0, 0, 0, 0]),
    ],
)
def test_a_whole_draft_is_scored_up_to_what_the_emitted_tokens_tell(emitted, reached, accepted):
    policy = AdaptiveDepth(max_depth=4)
    policy.observe_outcome("a", [7, 8, 9, 6], emitted, source=3)
    for counts in (policy._global, policy._sources[3], policy._requests["a"][3]):
        assert counts.reached.tolist() == reached
        assert counts.accepted.tolist() == accepted


def test_memory_bound_target_with_good_acceptance_drafts_deep():
    # A step costs 50 ms whatever its size: verifying drafts is almost free.
    policy = _policy(c0=0.05, c1=0.0001, c2=0.0001)
    _train(policy, "a", rate=0.8)
    assert policy.choose(["a"], [5]) == [5]


def test_hopeless_drafts_are_switched_off():
    policy = _policy(c0=0.05, c1=0.002, c2=0.004)
    _train(policy, "a", rate=0.02)
    assert policy.choose(["a"], [5]) == [0]


def test_depth_follows_each_requests_acceptance():
    policy = _policy(c0=0.02, c1=0.002, c2=0.002)
    _train(policy, "good", rate=0.9)
    _train(policy, "poor", rate=0.1)
    good, poor = policy.choose(["good", "poor"], [5, 5])
    assert good > poor


def test_large_compute_bound_batch_turns_speculation_off(caplog):
    # Each token costs 10 ms and the fixed cost is small: a batch of 64 saturates the machine.
    policy = _policy(c0=0.001, c1=0.01, c2=0.002)
    ids = [f"r{i}" for i in range(64)]
    for request_id in ids:
        _train(policy, request_id, rate=0.6, rounds=20)
    with caplog.at_level(logging.INFO, logger="sonar.spec_decode"):
        assert policy.choose(ids, [5] * 64) == [0] * 64
    assert "speculation off for a batch of 64" in caplog.text


def test_budgets_are_never_exceeded():
    policy = _policy(c0=0.05, c1=0.0001, c2=0.0001)
    _train(policy, "a", rate=0.95)
    assert policy.choose(["a", "b"], [2, 0]) == [2, 0]


def test_forget_drops_request_state():
    policy = AdaptiveDepth(max_depth=3)
    policy.observe_verification("a", 3, 0)
    before = policy.acceptance("a")
    policy.forget("a")
    assert policy.acceptance("a") == pytest.approx(policy.acceptance("never-seen"))
    assert not (before == policy.acceptance("a")).all()


def test_a_step_that_needs_one_more_tile_pass_is_priced_as_such():
    # Rows run in tiles of four: a step costs 12 ms per pass over the weights.
    policy = AdaptiveDepth(max_depth=8)
    for _ in range(6):
        for tokens in range(1, 10):
            policy.observe_step(tokens, 0, 0.012 * -(-tokens // 4), 0.0)
    _train(policy, "a", rate=0.8)
    # A straight line through these costs spreads the second pass over every row and stops at two
    # drafts; priced by passes, three drafts fill the first tile, and the fourth would need a
    # second pass that neither it nor the next three repay.
    assert policy.choose(["a"], [8]) == [3]
    assert policy.costs.seconds(9, 0) == pytest.approx(0.036, rel=0.02)


def test_logs_only_when_speculation_turns_off_or_on(caplog):
    policy = _policy(c0=0.05, c1=0.0001, c2=0.0001)
    _train(policy, "a", rate=0.8)
    with caplog.at_level(logging.INFO, logger="sonar.spec_decode"):
        policy.choose(["a"], [0])  # nothing to decide: prompt lookup found no match
        assert not caplog.records
        for budget in (5, 3, 0, 5, 2):
            policy.choose(["a"], [budget])
    assert [r.getMessage() for r in caplog.records] == [
        "auto depth: drafting ~5 tokens for 1 of 1 requests (max 5)"
    ]
