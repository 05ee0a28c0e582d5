"""Serving runs: requests over HTTP at a concurrency and an arrival rate, against a server the
benchmark starts for each row (``aphrodite serve`` with that row's speculative configuration) or
against one already running at a URL."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sonar_core.bench.cpu_load import LoadMeter, QuietPolicy, quietest
from sonar_core.bench.figures import row_figures
from sonar_core.bench.http_client import Endpoint, HTTPBenchError, stream_completion
from sonar_core.bench.offline import worker_env
from sonar_core.bench.peers.peer_protocol import BenchRequest, RequestRecord, RunResult, arrival_offsets
from sonar_core.bench.progress import Progress
from sonar_core.bench.prometheus import ServerSnapshot, parse_metrics
from sonar_core.bench.results import RowResult, compare, measure_in_passes
from sonar_core.bench.rows import RowSpec
from sonar_core.bench.server_process import ServerProcess, engine_flags
from sonar_core.bench.target import BenchTarget

logger = logging.getLogger("sonar.bench")
WARMUP_TOKENS = 16


@dataclass
class ServePlan:
    target: BenchTarget
    requests: list[BenchRequest]
    warmup_prompt_token_ids: list[int]
    rows: list[RowSpec]  # ignored when url is set: the running server is the only row
    concurrencies: list[int]
    max_tokens: int
    threads: int
    log_dir: Path
    request_rate: float = float("inf")
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # flags of the servers started here
    url: str | None = None
    api_key: str | None = None
    quiet: QuietPolicy | None = None  # applies to servers started here (a --url server's CPU is not ours)
    passes: int = 1  # measurements of every row's server, in alternating order; the fastest is kept

    @property
    def num_runs(self) -> int:
        return (1 if self.url else len(self.rows) * self.passes) * len(self.concurrencies)



def run_serve(plan: ServePlan, progress: Progress) -> list[RowResult]:
    if plan.url:
        endpoint = Endpoint(plan.url, plan.api_key)
        row = RowSpec("server", None, name=f"server {endpoint.url}")
        results = [_at_url(plan, endpoint, row, concurrency, progress) for concurrency in plan.concurrencies]
    else:
        runs = [(row, concurrency) for row in plan.rows for concurrency in plan.concurrencies]
        results = measure_in_passes(runs, lambda run: _with_own_server(plan, *run, progress), plan.passes)
    compare(results)
    return results


def _at_url(plan: ServePlan, endpoint: Endpoint, row: RowSpec, concurrency: int, progress: Progress) -> RowResult:
    """A running server, measured as it is: once, and with whatever it learnt from earlier requests."""
    outcome = RowResult(row, concurrency, plan.request_rate)
    progress.start_row(f"{row.label} c={concurrency}", len(plan.requests))
    try:
        outcome.result, _ = _measure(plan, endpoint, None, concurrency, progress.advance)
        outcome.figures = row_figures(outcome.result)
    except HTTPBenchError as exc:
        outcome.skipped = f"failed: {str(exc).splitlines()[0]}"
    finally:
        progress.finish_row()
    return outcome


def _with_own_server(plan: ServePlan, row: RowSpec, concurrency: int, progress: Progress) -> RowResult:
    """A fresh server for every measurement, so that a method that learns from earlier responses
    (suffix) never sees this workload before it is measured."""
    args = [plan.target.model] if plan.target.model else []
    args += engine_flags({"max_num_seqs": concurrency, **plan.engine_args})
    if row.method is not None:
        args += ["--speculative-config", json.dumps(row.options)]
    label = f"{row.label} c={concurrency}"
    log_path = plan.log_dir / f"server-{''.join(c if c.isalnum() else '_' for c in label)}.log"
    outcome = RowResult(row, concurrency, plan.request_rate)
    progress.start_row(label, len(plan.requests))

    def attempt(number: int) -> tuple[RunResult, float | None]:
        with ServerProcess(args, worker_env(plan.threads), log_path) as server:
            # The bar counts a row's requests once, on its first attempt.
            return _measure(plan, server.endpoint, server, concurrency, progress.advance if number == 1 else None)

    def busy(other: float | None) -> None:
        progress.write(f"{label}: other work kept {other:.1f} cores busy; measuring again")

    try:
        outcome.result, outcome.other_cpu, outcome.attempts = quietest(plan.quiet, attempt, busy)
        outcome.quiet = plan.quiet.is_quiet(outcome.other_cpu) if plan.quiet else None
        outcome.figures = row_figures(outcome.result)
    except HTTPBenchError as exc:
        logger.warning("%s failed: %s", label, exc)
        outcome.skipped = f"failed: {str(exc).splitlines()[0]}"
    finally:
        progress.finish_row()
    return outcome


def _measure(
    plan: ServePlan,
    endpoint: Endpoint,
    server: ServerProcess | None,
    concurrency: int,
    on_done: Callable[[int], None] | None,
) -> tuple[RunResult, float | None]:
    """One warm-up request, then the workload at ``concurrency``; the result and the other-work
    load (None for a server that is not ours: its CPU would count as other work)."""
    model = endpoint.model_id()
    version = _version(endpoint)
    stream_completion(endpoint, model, "warmup", plan.warmup_prompt_token_ids, WARMUP_TOKENS)
    meter = LoadMeter(pids=(server.pid,)).start() if server is not None else None
    before = _snapshot(endpoint)
    records, started, finished = run_load(
        endpoint, model, plan.requests, plan.max_tokens, concurrency, plan.request_rate, plan.seed, on_done
    )
    after = _snapshot(endpoint)
    other = meter.stop() if meter is not None else None
    return _result(version, records, started, finished, before, after, server, plan), other


def _result(
    version: str,
    records: list[RequestRecord],
    started: float,
    finished: float,
    before: ServerSnapshot,
    after: ServerSnapshot,
    server: ServerProcess | None,
    plan: ServePlan,
) -> RunResult:
    spec = after.spec.minus(before.spec) if after.spec is not None and before.spec is not None else None
    notes = ["client and server share the machine's cores"]
    if server is not None:
        peak = server.peak_rss_bytes()
        notes.append("peak RSS of the server process")
    else:
        peak = after.resident_memory_bytes
        notes.append(
            "memory: the server's resident set at the end of the run (from /metrics)"
            if peak is not None
            else "memory: unknown (the server's /metrics has no process_resident_memory_bytes)"
        )
    return RunResult(
        engine_version=version,
        precision=str(plan.engine_args.get("dtype", "auto")) if server is not None else "server's",
        requests=records,
        started=started,
        finished=finished,
        peak_rss_bytes=peak,
        rss_after_load_bytes=None,
        kv_cache_bytes=None,
        spec=spec if spec is not None and spec.num_drafts else None,
        notes=notes,
    )


def run_load(
    endpoint: Endpoint,
    model: str,
    requests: list[BenchRequest],
    max_tokens: int,
    concurrency: int,
    request_rate: float,
    seed: int,
    on_done: Callable[[int], None] | None = None,
) -> tuple[list[RequestRecord], float, float]:
    """Send ``requests`` at the arrival schedule, at most ``concurrency`` in flight (a request's
    clock starts when a connection is free and it is sent)."""

    def one(request: BenchRequest) -> RequestRecord:
        record = stream_completion(endpoint, model, request.id, request.prompt_token_ids, max_tokens)
        if on_done is not None:
            on_done(1)
        return record

    offsets = arrival_offsets(len(requests), request_rate, seed)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-client") as pool:
        futures = []
        for request, offset in zip(requests, offsets, strict=True):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, request))
        records = [future.result() for future in futures]
    return records, started, time.perf_counter()


def _snapshot(endpoint: Endpoint) -> ServerSnapshot:
    status, body = endpoint.get("/metrics")
    if status != 200:
        return ServerSnapshot(spec=None, resident_memory_bytes=None)
    return parse_metrics(body.decode("utf-8", errors="replace"))


def _version(endpoint: Endpoint) -> str:
    try:
        status, body = endpoint.get("/version")
        if status == 200:
            return f"server {json.loads(body).get('version', '?')}"
    except (OSError, ValueError):
        pass
    return "server"
