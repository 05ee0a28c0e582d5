"""Several passes over the rows: alternating order, the fastest pass kept, every pass reported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sonar_core.bench import offline
from sonar_core.bench.offline import OfflinePlan, run_offline
from sonar_core.bench.progress import Progress
from sonar_core.bench.results import RowResult, faster
from sonar_core.bench.rows import RowSpec


def test_passes_alternate_the_row_order_and_keep_each_rows_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [RowSpec("sonar", None), RowSpec("sonar", "ngram", {"method": "ngram"}), RowSpec("hf", None)]
    # Output tok/s each row measures on its 1st, 2nd and 3rd run.
    speeds = {"sonar": [10.0, 14.0, 12.0], "sonar ngram": [30.0, 20.0, 25.0], "hf": [5.0, 6.0, 7.0]}
    order: list[str] = []

    def fake_run_row(plan: OfflinePlan, row: RowSpec, concurrency: int, progress: Progress) -> RowResult:
        order.append(row.label)
        speed = speeds[row.label][order.count(row.label) - 1]
        outcome = RowResult(row, concurrency, float("inf"))
        outcome.figures = SimpleNamespace(output_throughput=speed)  # type: ignore[assignment]
        outcome.pass_throughputs = [speed]
        return outcome

    monkeypatch.setattr(offline, "run_row", fake_run_row)
    plan = SimpleNamespace(rows=rows, concurrencies=[1], passes=3)
    results = run_offline(plan, Progress(0, enabled=False))  # type: ignore[arg-type]
    assert order == ["sonar", "sonar ngram", "hf", "hf", "sonar ngram", "sonar", "sonar", "sonar ngram", "hf"]
    assert [r.figures.output_throughput for r in results] == [14.0, 30.0, 7.0]
    assert [r.pass_throughputs for r in results] == [[10.0, 14.0, 12.0], [30.0, 20.0, 25.0], [5.0, 6.0, 7.0]]


def test_a_skipped_row_stays_skipped_and_a_measured_pass_wins() -> None:
    skipped = RowResult(RowSpec("vllm", None), 1, float("inf"), skipped="not installed")
    measured = RowResult(RowSpec("vllm", None), 1, float("inf"))
    measured.figures = SimpleNamespace(output_throughput=3.0)  # type: ignore[assignment]
    assert faster(skipped, skipped) is skipped
    assert faster(skipped, measured) is measured
    assert faster(measured, skipped) is measured
