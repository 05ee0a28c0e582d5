"""Speculative-decoding acceptance metrics: counters, the periodic log line, Prometheus, a summary.

One *draft* is one request-step that verified at least one drafted token. For a draft of k tokens
of which a were accepted (the accepted prefix), the counters add

    num_drafts += 1, num_draft_tokens += k, num_accepted_tokens += a,
    num_accepted_tokens_per_pos[j] += 1 for every position j < a,

from which the documented figures follow:

    mean acceptance length = 1 + num_accepted_tokens / num_drafts   (tokens a step emits, with
                                                                     the recovered/bonus token)
    acceptance rate        = num_accepted_tokens / num_draft_tokens
    per-position rate[j]   = num_accepted_tokens_per_pos[j] / num_drafts
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Counter

logger = logging.getLogger("sonar.spec_decode")

LOG_FORMAT = (
    "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
    "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
    "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%"
)


@dataclass
class SpecDecodingSummary:
    """Acceptance figures over a span of steps, for the Python API."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    # 1 + accepted / drafts: tokens emitted per speculative step (1.0 when nothing was drafted).
    mean_acceptance_length: float
    # accepted / drafted tokens (0.0 when nothing was drafted).
    acceptance_rate: float
    # accepted at position j / drafts, per position (zeros when nothing was drafted).
    per_position_acceptance_rate: list[float]


@dataclass
class SpecDecodingStats:
    """Accumulates acceptance counts; positions run up to ``num_speculative_tokens``."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens
        elif len(self.num_accepted_tokens_per_pos) != self.num_speculative_tokens:
            raise ValueError("num_accepted_tokens_per_pos needs one count per speculative position")

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one request-step that verified ``num_draft_tokens`` drafts and accepted ``num_accepted``.

        A step without drafts is not a draft and is not counted.
        """
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted}) <= drafted ({num_draft_tokens}) "
                f"<= num_speculative_tokens ({self.num_speculative_tokens})"
            )
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Fold ``other``'s counts into these (same number of positions)."""
        if other.num_speculative_tokens != self.num_speculative_tokens:
            raise ValueError(
                f"cannot add stats for {other.num_speculative_tokens} positions to stats for "
                f"{self.num_speculative_tokens}"
            )
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    def copy(self) -> SpecDecodingStats:
        copy = SpecDecodingStats(self.num_speculative_tokens)
        copy.add(self)
        return copy

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts gained since ``earlier``, a :meth:`copy` of these cumulative stats."""
        return SpecDecodingStats(
            num_speculative_tokens=self.num_speculative_tokens,
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            num_accepted_tokens_per_pos=[
                now - before
                for now, before in zip(self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos, strict=True)
            ],
        )

    def summary(self) -> SpecDecodingSummary:
        drafts = self.num_drafts
        return SpecDecodingSummary(
            num_drafts=drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
            mean_acceptance_length=1.0 + self.num_accepted_tokens / drafts if drafts else 1.0,
            acceptance_rate=self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            per_position_acceptance_rate=[
                count / drafts if drafts else 0.0 for count in self.num_accepted_tokens_per_pos
            ],
        )


class SpecDecodingLogging:
    """Logs the ``SpecDecoding metrics`` line for the counts observed since the previous line.

    The engine calls :meth:`observe` every step and :meth:`maybe_log` as often as it likes; a
    line is written at most once per ``interval_s`` and only when the interval saw drafts.
    Throughputs are tokens divided by the seconds since the previous line (or since creation).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.interval_s = interval_s
        self._clock = clock
        self._interval = SpecDecodingStats(num_speculative_tokens)
        self._last_log_time = clock()
        self._seen: SpecDecodingStats | None = None  # the cumulative counts follow() last saw

    def observe(self, stats: SpecDecodingStats) -> None:
        self._interval.add(stats)

    def follow(self, cumulative: SpecDecodingStats) -> SpecDecodingStats | None:
        """Observe what the engine's cumulative counts gained since the previous call (the first
        call takes everything) and return that gain; None when there were no new drafts."""
        delta = cumulative.since(self._seen) if self._seen is not None else cumulative.copy()
        if not delta.num_drafts:
            return None
        self._seen = cumulative.copy()
        self.observe(delta)
        return delta

    def maybe_log(self) -> str | None:
        """Write the line when ``interval_s`` has passed since the last one; returns it, or None."""
        if self._clock() - self._last_log_time < self.interval_s:
            return None
        return self.log()

    def log(self) -> str | None:
        """Write the line for the current interval now and start a new interval; None without drafts.

        An interval without drafts still ends here, so that throughput after a quiet spell is
        measured over the time the drafts were made, not since the last line.
        """
        now = self._clock()
        stats = self._interval
        if stats.num_drafts == 0:
            self._last_log_time = now
            return None
        elapsed = now - self._last_log_time
        summary = stats.summary()
        args = (
            summary.mean_acceptance_length,
            stats.num_accepted_tokens / elapsed if elapsed > 0 else 0.0,
            stats.num_draft_tokens / elapsed if elapsed > 0 else 0.0,
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
            ", ".join(f"{rate:.3f}" for rate in summary.per_position_acceptance_rate),
            100.0 * summary.acceptance_rate,
        )
        logger.info(LOG_FORMAT, *args)
        self._interval = SpecDecodingStats(self.num_speculative_tokens)
        self._last_log_time = now
        return LOG_FORMAT % args


@dataclass(frozen=True)
class _Counters:
    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    num_accepted_tokens_per_pos: Counter


# One set of counters per registry: a second engine in the same process (or a second test)
# shares them instead of failing on duplicate metric names, and its samples carry its own
# model_name label.
_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, _Counters] = weakref.WeakKeyDictionary()


def _counters(registry: CollectorRegistry) -> _Counters:
    counters = _COUNTERS.get(registry)
    if counters is None:
        labels = ["model_name"]
        counters = _Counters(
            num_drafts=Counter(
                "aphrodite:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=registry
            ),
            num_draft_tokens=Counter(
                "aphrodite:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=registry
            ),
            num_accepted_tokens=Counter(
                "aphrodite:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels, registry=registry
            ),
            num_accepted_tokens_per_pos=Counter(
                "aphrodite:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=registry,
            ),
        )
        _COUNTERS[registry] = counters
    return counters


class SpecDecodingProm:
    """Prometheus counters ``aphrodite:spec_decode_*`` (exposed with ``_total``) for one model.

    ``registry`` defaults to prometheus_client's global registry, the one the server's
    ``/metrics`` exposes; tests and embedders pass their own.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        model_name: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        counters = _counters(REGISTRY if registry is None else registry)
        self.num_speculative_tokens = num_speculative_tokens
        self._num_drafts = counters.num_drafts.labels(model_name=model_name)
        self._num_draft_tokens = counters.num_draft_tokens.labels(model_name=model_name)
        self._num_accepted_tokens = counters.num_accepted_tokens.labels(model_name=model_name)
        # Children created up front, so every position is scraped (at 0) before it first accepts.
        self._per_pos = [
            counters.num_accepted_tokens_per_pos.labels(model_name=model_name, position=str(position))
            for position in range(num_speculative_tokens)
        ]

    def observe(self, stats: SpecDecodingStats) -> None:
        """Add a step's (or any span's) counts."""
        if stats.num_speculative_tokens != self.num_speculative_tokens:
            raise ValueError(
                f"stats cover {stats.num_speculative_tokens} positions, counters {self.num_speculative_tokens}"
            )
        self._num_drafts.inc(stats.num_drafts)
        self._num_draft_tokens.inc(stats.num_draft_tokens)
        self._num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, count in zip(self._per_pos, stats.num_accepted_tokens_per_pos, strict=True):
            counter.inc(count)


def guide_name_exposition(registry: CollectorRegistry | None = None) -> bytes:
    """The ``aphrodite:spec_decode_*`` counters of ``registry`` once more under their names without
    ``_total``, as untyped series, for queries written that way.

    The user guide's mean-acceptance query divides by ``rate(aphrodite:spec_decode_num_drafts[5m])``.
    Prometheus exposes a counter's samples only as ``NAME_total`` (prometheus_client, like vLLM's
    exposition, registers ``NAME``, ``NAME_total`` and ``NAME_created`` for one counter, so a second
    series named ``NAME`` cannot live in the same registry). This text is appended to ``/metrics``:
    a different metric name in the same text format, same values and labels, so both spellings of
    every query work.
    """
    from prometheus_client import generate_latest
    from prometheus_client.core import UnknownMetricFamily

    counters = _COUNTERS.get(REGISTRY if registry is None else registry)
    if counters is None:
        return b""

    class Mirror:
        def collect(self):
            for counter in (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens,
                            counters.num_accepted_tokens_per_pos):
                for metric in counter.collect():
                    totals = [sample for sample in metric.samples if sample.name == f"{metric.name}_total"]
                    names = list(totals[0].labels) if totals else []
                    family = UnknownMetricFamily(
                        metric.name, f"{metric.documentation} (the same as {metric.name}_total)", labels=names
                    )
                    for sample in totals:
                        family.add_metric([sample.labels[name] for name in names], sample.value)
                    yield family

    mirror = CollectorRegistry(auto_describe=False)
    mirror.register(Mirror())
    return generate_latest(mirror)
