"""Timing shared by the model benchmarks: variants timed in turn, so that background load on a
noisy machine hits all of them alike, and reported as medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternated_medians_ms(runs: Sequence[Callable[[], object]], iters: int, warmup: int = 1) -> list[float]:
    """Median milliseconds of each of ``runs``, after ``warmup`` untimed rounds, over ``iters``
    rounds that call each run once in turn."""
    for _ in range(warmup):
        for run in runs:
            run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(iters):
        for times, run in zip(samples, runs, strict=True):
            times.append(timed(run))
    return [statistics.median(times) * 1e3 for times in samples]
