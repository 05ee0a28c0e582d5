"""Draft depth per request: fixed, or adapted to measured acceptance and measured step cost.

The ``auto`` policy drafts where it pays. A step's throughput is the tokens it emits divided by
its duration. Drafting one more token for request *i* at depth *j* adds, in expectation, the
probability that drafts 1..j are all accepted (``gain``), and costs the extra target and proposer
work (``cost``). Adding it raises throughput exactly when ``gain / cost`` beats the current
tokens-per-second ratio, so the policy adds candidate drafts in decreasing order of gain while
that holds. With a large batch the fixed per-step cost is shared by many requests, the ratio is
already high, and no draft qualifies: speculation switches itself off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger("sonar.spec_decode")

# Pseudo-counts of the prior that a request's acceptance estimates start from (the batch-wide
# estimate), so that a new request does not swing on its first few drafts.
PRIOR_STRENGTH = 4.0
# Steps of timing data before the cost model is trusted; until then the policy drafts the maximum.
WARMUP_STEPS = 8
# Forgetting factor of the cost model, so that it follows changes in load.
COST_FORGETTING = 0.97


@dataclass
class _PositionCounts:
    """How often position j was reached (all earlier drafts accepted) and accepted."""

    reached: np.ndarray
    accepted: np.ndarray

    @classmethod
    def zeros(cls, depth: int) -> _PositionCounts:
        return cls(np.zeros(depth), np.zeros(depth))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        reached = min(num_drafted, num_accepted + 1)
        self.reached[:reached] += 1
        self.accepted[:num_accepted] += 1


class StepCostModel:
    """Step seconds ~ c0 + c1 * target tokens + c2 * drafted tokens, fitted online.

    Recursive least squares with forgetting over the engine's own steps, so the costs are those of
    this model on this machine under the current load.
    """

    def __init__(self) -> None:
        self._xtx = np.eye(3) * 1e-6
        self._xty = np.zeros(3)
        self.num_steps = 0

    def observe(self, num_target_tokens: int, num_drafted: int, seconds: float) -> None:
        x = np.array([1.0, num_target_tokens, num_drafted])
        self._xtx = COST_FORGETTING * self._xtx + np.outer(x, x)
        self._xty = COST_FORGETTING * self._xty + x * seconds
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float]:
        c0, c1, c2 = np.linalg.lstsq(self._xtx, self._xty, rcond=None)[0]
        # Costs cannot be negative; a noisy fit must not make drafting look free.
        return max(c0, 0.0), max(c1, 1e-9), max(c2, 0.0)


@dataclass
class AdaptiveDepth:
    """Chooses each request's draft length for the next step (``depth_policy: auto``)."""

    max_depth: int
    costs: StepCostModel = field(default_factory=StepCostModel)
    _global: _PositionCounts = field(init=False)
    _requests: dict[str, _PositionCounts] = field(default_factory=dict)
    _last_summary: str = ""

    def __post_init__(self) -> None:
        self._global = _PositionCounts.zeros(self.max_depth)

    def observe_verification(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        counts = self._requests.setdefault(request_id, _PositionCounts.zeros(self.max_depth))
        counts.observe(num_drafted, num_accepted)
        self._global.observe(num_drafted, num_accepted)

    def observe_step(self, num_target_tokens: int, num_drafted: int, seconds: float) -> None:
        self.costs.observe(num_target_tokens, num_drafted, seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance(self, request_id: str) -> np.ndarray:
        """Estimated probability that each position is accepted given the earlier ones were."""
        prior = (self._global.accepted + 0.5) / (self._global.reached + 1.0)
        counts = self._requests.get(request_id)
        if counts is None:
            return prior
        return (counts.accepted + PRIOR_STRENGTH * prior) / (counts.reached + PRIOR_STRENGTH)

    def choose(self, request_ids: list[str], budgets: list[int]) -> list[int]:
        """Draft lengths (each at most its budget) that maximise expected tokens per second."""
        if self.costs.num_steps < WARMUP_STEPS:
            return list(budgets)
        c0, c1, c2 = self.costs.coefficients()
        tokens = float(len(request_ids))
        seconds = c0 + c1 * len(request_ids)
        candidates: list[tuple[float, int]] = []
        for index, (request_id, budget) in enumerate(zip(request_ids, budgets, strict=True)):
            reach = np.cumprod(self.acceptance(request_id)[:budget])
            candidates.extend((float(gain), index) for gain in reach)
        candidates.sort(key=lambda c: -c[0])
        depths = [0] * len(request_ids)
        step_cost = c1 + c2
        for gain, index in candidates:
            if gain * seconds <= tokens * step_cost:
                break
            depths[index] += 1
            tokens += gain
            seconds += step_cost
        self._log_change(depths)
        return depths

    def _log_change(self, depths: list[int]) -> None:
        drafting = [d for d in depths if d]
        if not drafting:
            summary = f"auto depth: speculation off for a batch of {len(depths)} (drafting would cost throughput)"
        else:
            mean = round(sum(drafting) / len(drafting))
            summary = (
                f"auto depth: drafting ~{mean} tokens for {len(drafting)} of {len(depths)} requests "
                f"(max {self.max_depth})"
            )
        if summary != self._last_summary:
            logger.info(summary)
            self._last_summary = summary
