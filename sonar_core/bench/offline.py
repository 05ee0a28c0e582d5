"""Offline runs: every row's worker drives its engine in-process, at each requested concurrency."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sonar_core.bench.cpu_load import LoadMeter, QuietPolicy, competing_load, quietest
from sonar_core.bench.figures import row_figures
from sonar_core.bench.launcher import WorkerError, run_worker, sonar_command
from sonar_core.bench.peers import PEERS
from sonar_core.bench.peers.peer_protocol import BenchRequest, Job, RunResult
from sonar_core.bench.progress import Progress
from sonar_core.bench.results import RowResult, compare, measure_in_passes
from sonar_core.bench.rows import SONAR, RowSpec
from sonar_core.bench.target import BenchTarget

logger = logging.getLogger("sonar.bench")
# Variables that would make a peer's interpreter import Sonar's packages instead of its own.
_FOREIGN_PYTHON_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


@dataclass
class OfflinePlan:
    """Everything the rows of one offline table share."""

    target: BenchTarget
    requests: list[BenchRequest]
    warmup_prompt_token_ids: list[int]
    rows: list[RowSpec]
    dtype: str
    device: str
    threads: int
    max_tokens: int
    concurrencies: list[int]
    request_rate: float = float("inf")
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # Sonar's engine flags
    log_dir: Path | None = None  # keep each worker's output here
    quiet: QuietPolicy | None = None  # None: measure each row once, however busy the machine
    passes: int = 1  # measurements of every row, in alternating order; the fastest is kept
    competing_load: int = 0  # cores kept busy by spinning processes while each row runs

    @property
    def num_runs(self) -> int:
        return len(self.rows) * len(self.concurrencies) * self.passes


def run_offline(plan: OfflinePlan, progress: Progress) -> list[RowResult]:
    """Run every row at every concurrency, one after another (in ``plan.passes`` passes), then
    relate the rows."""
    runs = [(row, concurrency) for concurrency in plan.concurrencies for row in plan.rows]
    results = measure_in_passes(runs, lambda run: run_row(plan, *run, progress), plan.passes)
    compare(results)
    return results


def run_row(plan: OfflinePlan, row: RowSpec, concurrency: int, progress: Progress) -> RowResult:
    outcome = RowResult(row, concurrency, plan.request_rate)
    progress.start_row(f"{row.label} c={concurrency}", len(plan.requests))
    try:
        command, env = _command(plan, row, concurrency)
        log_path = plan.log_dir / f"{_slug(row.label)}-c{concurrency}.log" if plan.log_dir else None
        job = _job(plan, row, concurrency)

        def attempt(number: int) -> tuple[RunResult, float | None]:
            with competing_load(plan.competing_load):
                meter = LoadMeter().start()
                # The bar counts a row's requests once, on its first attempt.
                result = run_worker(command, job, env, progress.advance if number == 1 else None, log_path)
                # Read before the spinning processes are reaped: their CPU then becomes this
                # process's children's, which the meter counts as the benchmark's own.
                return result, meter.stop()

        def busy(other: float | None) -> None:
            progress.write(f"{row.label}: other work kept {other:.1f} cores busy; measuring again")

        outcome.result, outcome.other_cpu, outcome.attempts = quietest(plan.quiet, attempt, busy)
        outcome.quiet = plan.quiet.is_quiet(outcome.other_cpu) if plan.quiet else None
        outcome.figures = row_figures(outcome.result)
    except _Skip as skip:
        outcome.skipped = str(skip)
    except WorkerError as exc:
        logger.warning("%s failed: %s", row.label, exc)
        outcome.skipped = f"failed: {str(exc).splitlines()[-1]}"
    finally:
        progress.finish_row()
    return outcome


class _Skip(Exception):
    """A row that cannot run here, with the reason the table shows."""


def _command(plan: OfflinePlan, row: RowSpec, concurrency: int) -> tuple[list[str], dict[str, str]]:
    env = worker_env(plan.threads)
    if row.unavailable:
        raise _Skip(row.unavailable)
    if row.engine == SONAR:
        return sonar_command(), {**env, **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    peer = PEERS[row.engine]
    if concurrency > 1 and row.method not in peer.concurrent_modes:
        raise _Skip(f"{peer.title}{f' {row.method}' if row.method else ''} serves one request at a time")
    if peer.needs_gguf and plan.target.gguf_path is None:
        raise _Skip(f"{peer.title} reads GGUF files only; the target is not one")
    python = peer.python()
    if python is None:
        raise _Skip(f"not installed ({peer.install})")
    return [str(python), str(peer.worker_path())], env


def _job(plan: OfflinePlan, row: RowSpec, concurrency: int) -> Job:
    return Job(
        engine=row.engine,
        method=row.method,
        options=dict(row.options),
        model_dir=row.target_dir or str(plan.target.model_dir),
        gguf_path=str(plan.target.gguf_path) if plan.target.gguf_path else None,
        dtype=plan.dtype,
        device=plan.device,
        threads=plan.threads,
        max_tokens=plan.max_tokens,
        requests=plan.requests,
        warmup_prompt_token_ids=plan.warmup_prompt_token_ids,
        eos_token_ids=plan.target.eos_token_ids,
        concurrency=concurrency,
        request_rate=plan.request_rate,
        seed=plan.seed,
        engine_args={"model": row.target_dir or plan.target.model, **plan.engine_args} if row.engine == SONAR else {},
    )


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker: every engine gets the same thread count and stays offline."""
    env = {key: value for key, value in os.environ.items() if key not in _FOREIGN_PYTHON_ENV}
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
