"""A measured (or skipped) row, and the ratios that relate rows of one run to each other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from sonar_core.bench.figures import RowFigures, match_rate, prefix_agreement, ratio
from sonar_core.bench.peers.peer_protocol import RunResult
from sonar_core.bench.rows import SONAR, RowSpec


@dataclass
class RowResult:
    """One row at one concurrency: what ran, what it measured, or why it did not run."""

    row: RowSpec
    concurrency: int
    request_rate: float
    result: RunResult | None = None
    figures: RowFigures | None = None
    skipped: str | None = None  # why the row has no figures (not installed, failed, not applicable)
    other_cpu: float | None = None  # cores busy with other work while the row ran (see cpu_load)
    attempts: int = 1  # times measured; the quietest is kept (see cpu_load.QuietPolicy)
    quiet: bool | None = None  # whether other_cpu stayed under the policy's limit (None: no policy)
    pass_throughputs: list[float] = field(default_factory=list)  # output tok/s of each pass (see --passes)

    @property
    def label(self) -> str:
        return self.row.label

    @property
    def unreliable(self) -> str | None:
        """Why this row's figures cannot be trusted for a ratio (None: nothing seen): other work
        kept more than NOISY_OTHER_CPU cores busy while it ran, or its passes disagree by more
        than NOISY_PASS_SPREAD. Whether a quiet policy was set or not."""
        if self.quiet is False or (self.other_cpu is not None and self.other_cpu > NOISY_OTHER_CPU):
            return f"other work kept {self.other_cpu:.1f} cores busy while it ran"
        speeds = [speed for speed in self.pass_throughputs if speed > 0]
        if len(speeds) > 1 and max(speeds) / min(speeds) > 1 + NOISY_PASS_SPREAD:
            return f"its passes differ by {100 * (max(speeds) / min(speeds) - 1):.0f}%"
        return None


Run = TypeVar("Run")
# Beyond these a row is flagged and no ratio is stated from it without a mark: cores other work
# kept busy while the row ran, and the relative spread of its passes' throughputs.
NOISY_OTHER_CPU = 0.5
NOISY_PASS_SPREAD = 0.2


def measure_in_passes(runs: Sequence[Run], measure: Callable[[Run], RowResult], passes: int) -> list[RowResult]:
    """Measure every run once, then ``passes - 1`` more times, each further pass in the opposite
    order of the pass before, keeping each run's fastest pass.

    A shared machine slows down in spells that no CPU counter sees (another tenant's memory
    traffic can halve a memory-bound decode): a spell then lands on different rows in each pass,
    and the fastest pass is the least disturbed one.
    """
    results = [measure(run) for run in runs]
    speeds: list[list[float]] = [[] for _ in runs]

    def record(index: int, result: RowResult) -> None:
        if result.figures is not None:
            speeds[index].append(result.figures.output_throughput)

    for index, result in enumerate(results):
        record(index, result)
    for number in range(2, passes + 1):
        order = range(len(runs) - 1, -1, -1) if number % 2 == 0 else range(len(runs))
        for index in order:
            again = measure(runs[index])
            record(index, again)
            results[index] = faster(results[index], again)
    for result, history in zip(results, speeds, strict=True):
        result.pass_throughputs = history
    return results


def faster(kept: RowResult, again: RowResult) -> RowResult:
    """Of two measurements of one row, the one with the higher output throughput (a measured one
    over a skipped or failed one)."""
    if kept.figures is None or again.figures is None:
        return kept if kept.figures is not None else again
    return again if again.figures.output_throughput > kept.figures.output_throughput else kept


def compare(results: Sequence[RowResult]) -> None:
    """Fill each row's ratios: output throughput and output equality against the same engine's
    plain row (the speedup speculation brings), and against Sonar's plain row at the same
    concurrency (where Sonar stands)."""
    measured = [(r, r.figures, r.result) for r in results if r.figures is not None and r.result is not None]
    for item, figures, result in measured:
        same_load = [m for m in measured if (m[0].concurrency, m[0].request_rate) == (item.concurrency, item.request_rate)]
        plain = next((m for m in same_load if m[0].row.engine == item.row.engine and m[0].row.is_plain), None)
        sonar = next((m for m in same_load if m[0].row.engine == SONAR and m[0].row.is_plain), None)
        if plain is not None:
            _, plain_figures, plain_result = plain
            figures.speedup = ratio(figures.output_throughput, plain_figures.output_throughput)
            figures.speedup_unreliable = bool(item.unreliable or plain[0].unreliable)
            figures.match_plain = match_rate(result.requests, plain_result.requests)
        if sonar is not None:
            _, sonar_figures, sonar_result = sonar
            figures.vs_sonar = ratio(figures.output_throughput, sonar_figures.output_throughput)
            figures.vs_sonar_unreliable = bool(item.unreliable or sonar[0].unreliable)
            figures.match_sonar = match_rate(result.requests, sonar_result.requests)
            figures.prefix_agreement_sonar = prefix_agreement(result.requests, sonar_result.requests)
