"""Draft depth per request: fixed, or adapted to measured acceptance and measured step cost.

The ``auto`` policy drafts where it pays. A step's throughput is the tokens it emits divided by
its duration. Drafting one more token for request *i* at depth *j* adds, in expectation, the
probability that drafts 1..j are all accepted (``gain``), and costs the extra target and proposer
work (``cost``, which depends only on how many tokens the step runs and drafts). So the best
set of *m* drafts is the *m* of highest gain, and the policy keeps the *m* with the most tokens
per second. With a large batch the fixed per-step cost is shared by many requests, the ratio is
already high, and no draft pays for itself: speculation switches itself off.

Acceptance is learned per request and, where the proposer labels its drafts with what they rest on
(its *source*: prompt lookup's matched n-gram length), per source as well: a draft copied after a
five-token match is accepted far more often than one after a two-token match, so one rate per
position would verify too many of the one and too few of the other.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger("sonar.spec_decode")

# Pseudo-counts of the prior that a request's acceptance estimates start from (the batch-wide
# estimate), so that a new request does not swing on its first few drafts.
PRIOR_STRENGTH = 4.0
# Steps of timing data before the cost model is trusted; until then the policy drafts the maximum
# on every other step.
WARMUP_STEPS = 8
# Forgetting factor of the cost model, so that it follows changes in load.
COST_FORGETTING = 0.97
# Weight of observations of one step size before its own cost factor is used.
MIN_FACTOR_WEIGHT = 2.0


@dataclass
class PositionCounts:
    """How often position j was reached (all earlier drafts accepted) and accepted."""

    reached: np.ndarray
    accepted: np.ndarray

    @classmethod
    def zeros(cls, depth: int) -> PositionCounts:
        return cls(np.zeros(depth), np.zeros(depth))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        reached = min(num_drafted, num_accepted + 1)
        self.reached[:reached] += 1
        self.accepted[:num_accepted] += 1


class _LinearFit:
    """seconds ~ intercept + slope * count, by recursive least squares with forgetting."""

    def __init__(self) -> None:
        # Forgetting-weighted sums of 1, count, count^2, seconds and count * seconds: the normal
        # equations of the fit, solved in closed form after each step (it runs on every step).
        self._weight = self._counts = self._squares = self._seconds = self._products = 0.0
        self._coefficients = (0.0, 0.0)

    def observe(self, count: int, seconds: float) -> None:
        f = COST_FORGETTING
        self._weight = f * self._weight + 1.0
        self._counts = f * self._counts + count
        self._squares = f * self._squares + count * count
        self._seconds = f * self._seconds + seconds
        self._products = f * self._products + count * seconds
        spread = self._weight * self._squares - self._counts**2
        if spread > 1e-9 * self._weight**2:
            slope = (self._weight * self._products - self._counts * self._seconds) / spread
        else:  # every step so far had the same count: no slope can be told, only the level
            slope = 0.0
        self._coefficients = ((self._seconds - slope * self._counts) / self._weight, slope)

    def coefficients(self) -> tuple[float, float]:
        return self._coefficients

    def predict(self, count: int) -> float:
        """The fitted seconds, with costs that cannot be negative (a noisy fit must not make
        drafting look free)."""
        intercept, slope = self._coefficients
        return max(intercept, 0.0) + max(slope, 0.0) * count


class _StepwiseFit:
    """A :class:`_LinearFit` times a factor learned for each count.

    CPU kernels run rows in register tiles (four on AVX2), so a step that needs one more pass
    costs far more than one that fills a tile: nine rows cost almost three decode steps where
    eight cost 1.8. A straight line would verify a fifth or a ninth row at the price of a fourth.
    The factor (measured over fitted seconds) is kept per count with forgetting, so it keeps the
    curve's shape while the line follows changes of load.
    """

    def __init__(self) -> None:
        self.line = _LinearFit()
        # count -> (forgetting-weighted sum of measured / fitted, weight)
        self._factors: dict[int, tuple[float, float]] = {}

    def observe(self, count: int, seconds: float) -> None:
        self.line.observe(count, seconds)
        fitted = self.line.predict(count)
        if fitted > 0:
            total, weight = self._factors.get(count, (0.0, 0.0))
            self._factors[count] = (COST_FORGETTING * total + seconds / fitted, COST_FORGETTING * weight + 1.0)

    def predict(self, count: int) -> float:
        fitted = self.line.predict(count)
        total, weight = self._factors.get(count, (0.0, 0.0))
        return fitted * total / weight if weight >= MIN_FACTOR_WEIGHT else fitted


class StepCostModel:
    """Step seconds ~ target(target tokens) + proposer(drafted tokens), fitted online.

    The target's part of a step (everything but proposing) and the proposer's part are fitted
    apart, each on its own count: in one fit the two counts move together (a request that drafted
    k tokens last step verifies k + 1 this step and drafts k again), so the split between them
    would be arbitrary. The target's part is a line times a factor per token count (see
    :class:`_StepwiseFit`), the proposer's a line. Fitted over the engine's own steps, so the
    costs are those of this model on this machine under the current load.
    """

    def __init__(self) -> None:
        self._target = _StepwiseFit()
        self._proposer = _LinearFit()
        self.num_steps = 0

    def observe(self, num_target_tokens: int, num_drafted: int, seconds: float, propose_seconds: float) -> None:
        """One step: ``seconds`` in all, of which ``propose_seconds`` drafting ``num_drafted`` tokens."""
        self._target.observe(num_target_tokens, seconds - propose_seconds)
        self._proposer.observe(num_drafted, propose_seconds)
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float]:
        """The straight-line costs: fixed seconds a step, per target token, per drafted token."""
        target_fixed, per_token = self._target.line.coefficients()
        proposer_fixed, per_draft = self._proposer.coefficients()
        return target_fixed + proposer_fixed, per_token, per_draft

    def seconds(self, num_target_tokens: int, num_drafted: int) -> float:
        """Predicted seconds of a step with these counts (never zero)."""
        return max(self._target.predict(num_target_tokens) + self._proposer.predict(num_drafted), 1e-9)


@dataclass
class AdaptiveDepth:
    """Chooses each request's draft length for the next step (``depth_policy: auto``).

    Estimates shrink towards broader ones: a request's rates for a source towards that source's
    rates over every request, and those towards the rates of all drafts, so a new request or a
    rarely seen source starts from what the rest of the traffic measured.
    """

    max_depth: int
    costs: StepCostModel = field(default_factory=StepCostModel)
    _global: PositionCounts = field(init=False)
    _sources: dict[Hashable, PositionCounts] = field(default_factory=dict)
    _requests: dict[str, dict[Hashable, PositionCounts]] = field(default_factory=dict)
    # Whether the last logged decision was to draft (None: nothing logged yet).
    _drafting: bool | None = None

    def __post_init__(self) -> None:
        self._global = PositionCounts.zeros(self.max_depth)

    def observe_verification(
        self, request_id: str, num_drafted: int, num_accepted: int, source: Hashable = None
    ) -> None:
        """Record that ``num_accepted`` of ``num_drafted`` drafts labelled ``source`` were accepted."""
        for counts in (
            self._global,
            self._sources.setdefault(source, PositionCounts.zeros(self.max_depth)),
            self._requests.setdefault(request_id, {}).setdefault(source, PositionCounts.zeros(self.max_depth)),
        ):
            counts.observe(num_drafted, num_accepted)

    def observe_outcome(
        self, request_id: str, drafts: Sequence[int], emitted: Sequence[int], source: Hashable = None
    ) -> None:
        """Score whole one-hot ``drafts`` against the tokens the request emitted after them, cut or
        verified alike (such a draft is accepted exactly as often as the target's next token equals
        it): positions up to the first mismatch, or as many as ``emitted`` covers; later ones are
        unknown and left out."""
        matched = matched_prefix(drafts, emitted)
        observed = matched + 1 if matched < min(len(drafts), len(emitted)) else matched
        self.observe_verification(request_id, observed, matched, source)

    def observe_step(self, num_target_tokens: int, num_drafted: int, seconds: float, propose_seconds: float) -> None:
        self.costs.observe(num_target_tokens, num_drafted, seconds, propose_seconds)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance(self, request_id: str, source: Hashable = None) -> np.ndarray:
        """Estimated probability that each position is accepted given the earlier ones were."""
        estimate = (self._global.accepted + 0.5) / (self._global.reached + 1.0)
        if source is not None:
            estimate = _shrink(self._sources.get(source), estimate)
        return _shrink(self._requests.get(request_id, {}).get(source), estimate)

    def choose(
        self, request_ids: list[str], budgets: list[int], sources: Sequence[Hashable] | None = None
    ) -> list[int]:
        """Draft lengths (each at most its budget) that maximise expected tokens per second;
        ``sources`` labels each request's drafts (None: unlabelled)."""
        if self.costs.num_steps < WARMUP_STEPS:
            # Every other warm-up step drafts nothing, so that the cost model sees steps of
            # different sizes even where acceptance would keep every step at full depth.
            return list(budgets) if self.costs.num_steps % 2 == 0 else [0] * len(budgets)
        if sources is None:
            sources = [None] * len(request_ids)
        # Adding drafts in decreasing order of gain is best for any number of drafts, as the cost
        # depends only on how many; the number is the one with the most tokens per second.
        candidates: list[tuple[float, int]] = []
        for index, (request_id, budget, source) in enumerate(zip(request_ids, budgets, sources, strict=True)):
            reach = np.cumprod(self.acceptance(request_id, source)[:budget])
            candidates.extend((float(gain), index) for gain in reach)
        candidates.sort(key=lambda c: -c[0])
        batch = len(request_ids)
        tokens = float(batch)
        best_count, best_rate = 0, tokens / self.costs.seconds(batch, 0)
        for count, (gain, _) in enumerate(candidates, start=1):
            tokens += gain
            rate = tokens / self.costs.seconds(batch + count, count)
            if rate > best_rate:
                best_count, best_rate = count, rate
        depths = [0] * batch
        for _, index in candidates[:best_count]:
            depths[index] += 1
        self._log_change(depths, budgets)
        return depths

    def _log_change(self, depths: list[int], budgets: list[int]) -> None:
        """Log when speculation turns off or on; steps where no request could draft (prompt
        lookup found nothing) decide nothing, and depths that vary step by step are not news."""
        offered = sum(1 for budget in budgets if budget)
        if not offered:
            return
        drafting = [d for d in depths if d]
        if bool(drafting) == self._drafting:
            return
        self._drafting = bool(drafting)
        if not drafting:
            logger.info(f"auto depth: speculation off for a batch of {offered} (drafting would cost throughput)")
        else:
            mean = round(sum(drafting) / len(drafting))
            logger.info(
                f"auto depth: drafting ~{mean} tokens for {len(drafting)} of {len(depths)} requests "
                f"(max {self.max_depth})"
            )


def _shrink(counts: PositionCounts | None, prior: np.ndarray) -> np.ndarray:
    """Rates from ``counts`` pulled towards ``prior`` by PRIOR_STRENGTH pseudo-observations."""
    if counts is None:
        return prior
    return (counts.accepted + PRIOR_STRENGTH * prior) / (counts.reached + PRIOR_STRENGTH)


def matched_prefix(drafts: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray) -> int:
    """How many leading drafts equal the tokens that came where they were drafted."""
    count = 0
    while count < min(len(drafts), len(tokens)) and drafts[count] == tokens[count]:
        count += 1
    return count
