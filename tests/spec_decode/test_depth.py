import logging

import pytest

from sonar_core.spec_decode.depth import WARMUP_STEPS, AdaptiveDepth


def _policy(c0: float, c1: float, c2: float, max_depth: int = 5) -> AdaptiveDepth:
    """A policy whose cost model has seen steps that follow c0 + c1*T + c2*D exactly."""
    policy = AdaptiveDepth(max_depth)
    for target_tokens, drafted in [(1, 0), (5, 4), (16, 0), (40, 24), (3, 2), (64, 48), (8, 1), (2, 2), (30, 7)]:
        policy.observe_step(target_tokens, drafted, c0 + c1 * target_tokens + c2 * drafted)
    return policy


def _train(policy: AdaptiveDepth, request_id: str, rate: float, rounds: int = 200) -> None:
    """Feed verifications in which every position is accepted with probability `rate`."""
    for i in range(rounds):
        accepted = 0
        while accepted < policy.max_depth and ((i * 7919 + accepted * 104729) % 1000) / 1000 < rate:
            accepted += 1
        policy.observe_verification(request_id, policy.max_depth, accepted)


def test_drafts_the_maximum_until_the_cost_model_is_warm():
    policy = AdaptiveDepth(max_depth=4)
    for _ in range(WARMUP_STEPS - 1):
        policy.observe_step(1, 0, 0.05)
    assert policy.choose(["a", "b"], [4, 2]) == [4, 2]


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
