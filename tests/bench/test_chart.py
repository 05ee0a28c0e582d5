"""The optional PNG chart (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar_core.bench.chart import write_chart
from sonar_core.bench.figures import row_figures
from sonar_core.bench.peers.peer_protocol import RequestRecord, RunResult, SpecCounts
from sonar_core.bench.results import RowResult
from sonar_core.bench.rows import RowSpec

pytest.importorskip("matplotlib")


def _row(method: str | None, concurrency: int) -> RowResult:
    result = RunResult(
        engine_version="v", precision="float32", requests=[RequestRecord("a", 0.0, events=[(0.1, 1), (0.2, 3)])],
        started=0.0, finished=0.5 / concurrency, peak_rss_bytes=1, rss_after_load_bytes=None, kv_cache_bytes=None,
        spec=SpecCounts(2, 6, 3, [2, 1, 0]) if method else None,
    )
    return RowResult(RowSpec("sonar", method), concurrency, float("inf"), result, row_figures(result))


def test_chart_of_acceptance_and_throughput(tmp_path: Path) -> None:
    rows = [_row(None, 1), _row(None, 4), _row("ngram", 1), _row("ngram", 4)]
    path = tmp_path / "chart.png"
    assert write_chart(path, [("t", rows)])
    assert path.read_bytes().startswith(b"\x89PNG")


def test_nothing_to_draw(tmp_path: Path) -> None:
    assert not write_chart(tmp_path / "chart.png", [("t", [_row(None, 1)])])
