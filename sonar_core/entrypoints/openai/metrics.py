"""Server metrics: Prometheus request/latency/engine-state series and the periodic stats log.

Everything here runs on the engine thread, once per step, from the :class:`RequestOutput` objects
the step returned; the HTTP side only renders the registry. The speculative-decoding counters and
the ``SpecDecoding metrics:`` log line belong to :mod:`sonar_core.spec_decode.metrics`; this module
feeds them the per-step change of the engine's cumulative :class:`SpecDecodingStats`.

Prometheus series (all labelled ``model_name``):

- ``aphrodite:num_requests_running`` / ``aphrodite:num_requests_waiting`` (gauges)
- ``aphrodite:kv_cache_usage_perc`` (gauge, 0..1)
- ``aphrodite:prefix_cache_queries_total`` / ``aphrodite:prefix_cache_hits_total`` (tokens of
  admitted requests, and of those the tokens found in the prefix cache)

  These five describe an engine's state. A data-parallel server has one set per replica, labelled
  ``engine="0"``, ``engine="1"``, ... as vLLM's are, and no unlabelled set beside them (a
  ``sum()`` over the series would count the total twice): ``sum without (engine) (...)`` is the
  server's total. Every other series is the server's, over all replicas.
- ``aphrodite:prompt_tokens_total`` / ``aphrodite:generation_tokens_total``
- ``aphrodite:request_success_total`` (label ``finished_reason``: stop, length, abort)
- ``aphrodite:time_to_first_token_seconds``, ``aphrodite:inter_token_latency_seconds``,
  ``aphrodite:e2e_request_latency_seconds`` (histograms)
- ``aphrodite:spec_decode_*`` (from the spec-decode module)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sonar_core.outputs import RequestOutput
from sonar_core.spec_decode.metrics import (
    SpecDecodingLogging,
    SpecDecodingProm,
    SpecDecodingStats,
    guide_name_exposition,
)

logger = logging.getLogger("sonar.server")

LOG_INTERVAL_S = 5.0
THROUGHPUT_LOG_FORMAT = (
    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%"
)
# Latency buckets in seconds, from sub-millisecond decode steps on a GPU to minutes on a busy CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)


@dataclass(frozen=True)
class EngineState:
    """What the gauges and the log line show about the engine at one moment."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    # Cumulative prefix-cache counts (tokens), as the engine reports them.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineSeries:
    """The engine-state series of one engine (or replica): gauges set to its state, prefix-cache
    counters advanced by what its cumulative counts gained since the previous state."""

    def __init__(self, families: Sequence[Gauge | Counter], labels: Sequence[str]) -> None:
        running, waiting, kv_cache_usage, prefix_queries, prefix_hits = (f.labels(*labels) for f in families)
        self.num_running, self.num_waiting, self.kv_cache_usage = running, waiting, kv_cache_usage
        self.prefix_cache_queries, self.prefix_cache_hits = prefix_queries, prefix_hits
        self._prefix_seen = (0, 0)

    def observe(self, state: EngineState) -> None:
        self.num_running.set(state.num_running)
        self.num_waiting.set(state.num_waiting)
        self.kv_cache_usage.set(state.kv_cache_usage)
        queries, hits = state.prefix_cache_queries, state.prefix_cache_hits
        self.prefix_cache_queries.inc(max(queries - self._prefix_seen[0], 0))
        self.prefix_cache_hits.inc(max(hits - self._prefix_seen[1], 0))
        self._prefix_seen = (queries, hits)


class ServerMetrics:
    """The Prometheus series of one server, in a registry of its own.

    A registry per server (not prometheus_client's global one) keeps two servers in one process,
    as tests run them, from sharing or double-registering series. ``num_engines`` above 1 (a
    data-parallel server) gives the engine-state series an ``engine`` label, one set per replica
    in :attr:`engines`.
    """

    def __init__(self, model_name: str, num_speculative_tokens: int, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.model_name = model_name
        replicated = num_engines > 1
        engine_labels = [*labels, "engine"] if replicated else labels
        families = (
            Gauge("aphrodite:num_requests_running", "Requests in the running batch.", engine_labels, registry=reg),
            Gauge("aphrodite:num_requests_waiting", "Requests waiting to be scheduled.", engine_labels, registry=reg),
            Gauge("aphrodite:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", engine_labels,
                  registry=reg),
            Counter("aphrodite:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", engine_labels,
                    registry=reg),
            Counter("aphrodite:prefix_cache_hits", "Prompt tokens found in the prefix cache.", engine_labels,
                    registry=reg),
        )
        label_sets = [[model_name, str(index)] for index in range(num_engines)] if replicated else [[model_name]]
        self.engines = [EngineSeries(families, label_set) for label_set in label_sets]
        self.prompt_tokens = Counter(
            "aphrodite:prompt_tokens", "Prompt tokens prefilled.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "aphrodite:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self._request_success = Counter(
            "aphrodite:request_success", "Requests that ended, by finish reason.", [*labels, "finished_reason"],
            registry=reg,
        )
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
        self.time_to_first_token = Histogram(
            "aphrodite:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            labels, buckets=TTFT_BUCKETS, registry=reg,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "aphrodite:inter_token_latency_seconds", "Time between consecutive generated tokens.",
            labels, buckets=ITL_BUCKETS, registry=reg,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "aphrodite:e2e_request_latency_seconds", "Time from arrival to the last token of a request.",
            labels, buckets=E2E_BUCKETS, registry=reg,
        ).labels(model_name)
        self.spec_decode = SpecDecodingProm(num_speculative_tokens, model_name, registry=reg)

    def request_finished(self, finished_reason: str) -> None:
        self._request_success.labels(self.model_name, finished_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series, and the speculative-decoding counters
        under their names without ``_total`` too (see guide_name_exposition)."""
        return generate_latest(self.registry) + guide_name_exposition(self.registry)


@dataclass
class _Tracked:
    """How much of one request's timing has been recorded already."""

    first_token_seen: bool = False
    num_latencies_seen: int = 0


class StatsRecorder:
    """Turns each step's outputs into metrics and, unless disabled, the periodic log lines.

    Every ``interval_s`` with activity it logs the throughput line and then the
    ``SpecDecoding metrics:`` line of the same interval; one more throughput line follows the
    last active interval so that the log shows the engine going idle. The lines show the state
    :meth:`observe_engine` is given: a data-parallel server's totals. ``replica_states`` (a
    data-parallel server's) gives each replica's state, in the order of ``metrics.engines``, for
    the labelled series.
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        spec_stats: SpecDecodingStats,
        *,
        log_stats: bool,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        replica_states: Callable[[], Sequence[EngineState]] | None = None,
    ) -> None:
        self.metrics = metrics
        self._replica_states = replica_states
        self.log_stats = log_stats
        self.interval_s = interval_s
        self._clock = clock
        self._spec_stats = spec_stats
        self._spec_logging = SpecDecodingLogging(spec_stats.num_speculative_tokens, interval_s, clock)
        self._tracked: dict[str, _Tracked] = {}
        self._interval_prompt_tokens = 0
        self._interval_generation_tokens = 0
        self._last_log_time = clock()
        self._last_interval_active = False
        # Prefix-cache counts at the last log line.
        self._prefix_logged = (0, 0)

    def observe_outputs(self, outputs: list[RequestOutput]) -> None:
        """Record one step's outputs: token counts, first-token and inter-token times, finishes."""
        for output in outputs:
            tracked = self._tracked.setdefault(output.request_id, _Tracked())
            new_tokens = len(output.delta_token_ids)
            self.metrics.generation_tokens.inc(new_tokens)
            self._interval_generation_tokens += new_tokens
            timing = output.metrics
            if not tracked.first_token_seen and timing.time_to_first_token is not None:
                tracked.first_token_seen = True
                num_prompt = len(output.prompt_token_ids)
                self.metrics.prompt_tokens.inc(num_prompt)
                self._interval_prompt_tokens += num_prompt
                self.metrics.time_to_first_token.observe(timing.time_to_first_token)
            for latency in timing.inter_token_latencies[tracked.num_latencies_seen :]:
                self.metrics.inter_token_latency.observe(latency)
            tracked.num_latencies_seen = len(timing.inter_token_latencies)
            if output.finished:
                del self._tracked[output.request_id]
                self.metrics.request_finished(output.outputs[0].finish_reason or "stop")
                if timing.e2e_latency is not None:
                    self.metrics.e2e_latency.observe(timing.e2e_latency)

    def observe_abort(self, request_id: str) -> None:
        """Record a request that ended without finishing (client gone, failure or shutdown)."""
        self._tracked.pop(request_id, None)
        self.metrics.request_finished("abort")

    def observe_engine(self, state: EngineState) -> None:
        """Update the engine-state series and pass on the speculative-decoding counts added since
        last time."""
        states = self._replica_states() if self._replica_states is not None else [state]
        for series, engine_state in zip(self.metrics.engines, states, strict=True):
            series.observe(engine_state)
        delta = self._spec_logging.follow(self._spec_stats)
        if delta is not None:
            self.metrics.spec_decode.observe(delta)

    def maybe_log(self, state: EngineState) -> None:
        """Write the periodic lines when ``interval_s`` has passed (only with log_stats)."""
        if not self.log_stats:
            return
        now = self._clock()
        elapsed = now - self._last_log_time
        if elapsed < self.interval_s:
            return
        active = bool(
            self._interval_prompt_tokens or self._interval_generation_tokens
            or state.num_running or state.num_waiting
        )
        queries = state.prefix_cache_queries - self._prefix_logged[0]
        hits = state.prefix_cache_hits - self._prefix_logged[1]
        self._prefix_logged = (state.prefix_cache_queries, state.prefix_cache_hits)
        if active or self._last_interval_active:
            logger.info(
                THROUGHPUT_LOG_FORMAT,
                self._interval_prompt_tokens / elapsed,
                self._interval_generation_tokens / elapsed,
                state.num_running,
                state.num_waiting,
                100.0 * state.kv_cache_usage,
                100.0 * hits / queries if queries > 0 else 0.0,
            )
            self._spec_logging.log()
        self._last_interval_active = active
        self._interval_prompt_tokens = 0
        self._interval_generation_tokens = 0
        self._last_log_time = now
