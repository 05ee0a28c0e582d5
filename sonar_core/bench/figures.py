"""The seven documented figures of one row, computed the same way for every engine from the
worker's timings (never from an engine's own statistics, which peers define differently).

- time to first token: submission to the first emitted token, per request;
- inter-token latency: the gap between consecutive emissions, shared evenly by the tokens of an
  emission (a step that accepts three drafts emits four tokens after one gap), per token;
- end-to-end latency: submission to the last token, per request;
- request throughput: requests / (first submission to last token), at the row's concurrency;
- memory: the worker's peak resident set size, and the KV cache the engine allocated;
- mean acceptance length and per-position acceptance rate: from the engine's acceptance counters
  where it keeps them (see :mod:`sonar_core.spec_decode.metrics` for the definitions); tokens per
  decode step is measured for every engine from the emissions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sonar_core.bench.peers.peer_protocol import RequestRecord, RunResult, SpecCounts


@dataclass(frozen=True)
class Distribution:
    """Median, 90th percentile and mean of a sample (NaN for an empty sample)."""

    p50: float
    p90: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(math.nan, math.nan, math.nan, 0)
        ordered = sorted(values)
        return cls(percentile(ordered, 50), percentile(ordered, 90), sum(ordered) / len(ordered), len(ordered))


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolating linearly between ranks (numpy's default)."""
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Acceptance:
    mean_acceptance_length: float
    acceptance_rate: float
    per_position: list[float]

    @classmethod
    def of(cls, counts: SpecCounts) -> Acceptance | None:
        """None when nothing was drafted (there is no rate to speak of)."""
        drafts = counts.num_drafts
        if drafts == 0:
            return None
        return cls(
            mean_acceptance_length=1.0 + counts.num_accepted_tokens / drafts,
            acceptance_rate=counts.num_accepted_tokens / counts.num_draft_tokens if counts.num_draft_tokens else 0.0,
            per_position=[count / drafts for count in counts.accepted_per_pos],
        )


@dataclass
class RowFigures:
    """Everything a table row shows, in seconds, bytes and plain ratios."""

    num_requests: int
    output_tokens: int
    ttft: Distribution
    itl: Distribution
    e2e: Distribution
    request_throughput: float  # requests per second
    output_throughput: float  # output tokens per second
    tokens_per_step: float  # tokens per emission after the first (1.0 without speculation)
    peak_rss_bytes: int | None
    kv_cache_bytes: int | None
    peak_device_bytes: int | None
    acceptance: Acceptance | None
    # Time in the proposer as a fraction of time in the target's forward (Sonar's speculative rows).
    draft_cost: float | None = None
    # Filled by compare(): against the same engine's plain row, and against Sonar's plain row.
    speedup: float | None = None
    vs_sonar: float | None = None
    # True when either row of the ratio was measured under load or with disagreeing passes.
    speedup_unreliable: bool = False
    vs_sonar_unreliable: bool = False
    match_plain: float | None = None
    match_sonar: float | None = None
    prefix_agreement_sonar: float | None = None
    notes: list[str] = field(default_factory=list)


def ttft(record: RequestRecord) -> float | None:
    return record.events[0][0] - record.submitted if record.events else None


def e2e(record: RequestRecord) -> float | None:
    return record.events[-1][0] - record.submitted if record.events else None


def inter_token_gaps(record: RequestRecord) -> list[float]:
    gaps: list[float] = []
    for (before, _), (now, count) in zip(record.events, record.events[1:], strict=False):
        gaps += [(now - before) / count] * count
    return gaps


def row_figures(result: RunResult) -> RowFigures:
    records = result.requests
    elapsed = max(result.finished - result.started, 1e-9)
    tokens = sum(sum(count for _, count in record.events) for record in records)
    decode_events = sum(max(len(record.events) - 1, 0) for record in records)
    decode_tokens = sum(sum(count for _, count in record.events[1:]) for record in records)
    return RowFigures(
        num_requests=len(records),
        output_tokens=tokens,
        ttft=Distribution.of([v for v in map(ttft, records) if v is not None]),
        itl=Distribution.of([gap for record in records for gap in inter_token_gaps(record)]),
        e2e=Distribution.of([v for v in map(e2e, records) if v is not None]),
        request_throughput=len(records) / elapsed,
        output_throughput=tokens / elapsed,
        tokens_per_step=decode_tokens / decode_events if decode_events else math.nan,
        peak_rss_bytes=result.peak_rss_bytes,
        kv_cache_bytes=result.kv_cache_bytes,
        peak_device_bytes=result.peak_device_bytes,
        acceptance=Acceptance.of(result.spec) if result.spec is not None else None,
        draft_cost=(
            result.propose_seconds / result.target_seconds
            if result.propose_seconds is not None and result.target_seconds
            else None
        ),
        notes=list(result.notes),
    )


def output_of(record: RequestRecord) -> list[int] | str:
    """What two runs are compared on: token ids, or the text where ids are unknown (HTTP)."""
    return record.text if record.text is not None else record.token_ids


def match_rate(rows: Sequence[RequestRecord], reference: Sequence[RequestRecord]) -> float | None:
    """Fraction of requests whose output equals the reference run's for the same prompt."""
    expected = {record.id: output_of(record) for record in reference}
    pairs = [(output_of(record), expected[record.id]) for record in rows if record.id in expected]
    if not pairs:
        return None
    return sum(mine == theirs for mine, theirs in pairs) / len(pairs)


def prefix_agreement(rows: Sequence[RequestRecord], reference: Sequence[RequestRecord]) -> float | None:
    """Mean fraction of the reference's tokens reproduced before the first difference: how far two
    engines of different precision stay together, where exact equality is too strict a test."""
    expected = {record.id: output_of(record) for record in reference}
    fractions = []
    for record in rows:
        theirs = expected.get(record.id)
        if theirs is None or not theirs:
            continue
        mine = output_of(record)
        same = 0
        for a, b in zip(mine, theirs, strict=False):
            if a != b:
                break
            same += 1
        fractions.append(same / len(theirs))
    return sum(fractions) / len(fractions) if fractions else None


def ratio(value: float, reference: float) -> float | None:
    if not reference or math.isnan(reference) or math.isnan(value):
        return None
    return value / reference
