"""An optional PNG: acceptance rate by draft position for every speculative row, and output
throughput against concurrency for every configuration measured at more than one.

Needs matplotlib (``pip install 'sonar-core[bench]'``); without it the chart is skipped with a
message, never the benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sonar_core.bench.results import RowResult


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_chart(path: Path, tables: Sequence[tuple[str, Sequence[RowResult]]]) -> bool:
    """Draw the chart of ``(title, rows)`` tables into ``path``; False when there is nothing to draw.

    One panel per table and kind, stacked, each with its legend beside it: a suite has a dozen
    rows per table, which one shared panel could not tell apart.
    """
    panels: list[tuple[str, str, dict[str, list[tuple[float, float]]]]] = []
    for title, rows in tables:
        lowest = min((r.concurrency for r in rows), default=1)
        acceptance = {
            item.label: [(position + 1, rate) for position, rate in enumerate(_trimmed(item.figures.acceptance.per_position))]
            for item in rows
            if item.figures is not None and item.figures.acceptance is not None and item.concurrency == lowest
        }
        curves: dict[str, list[tuple[float, float]]] = {}
        for item in rows:
            if item.figures is not None:
                curves.setdefault(item.label, []).append((item.concurrency, item.figures.output_throughput))
        curves = {label: sorted(points) for label, points in curves.items() if len(points) > 1}
        if acceptance:
            panels.append((f"{title}: acceptance by draft position", "acceptance", acceptance))
        if curves:
            panels.append((f"{title}: throughput against concurrency", "throughput", curves))
    if not panels:
        return False

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 3.4 * len(panels)), squeeze=False)
    for axis, (title, kind, series) in zip(axes[:, 0], panels, strict=True):
        for label, points in series.items():
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        if kind == "acceptance":
            axis.set_xlabel("draft position")
            axis.set_ylabel("acceptance rate")
            axis.set_ylim(0, 1.02)
        else:
            axis.set_xlabel("concurrency")
            axis.set_ylabel("output tokens / s")
        axis.set_title(title, fontsize="medium")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _trimmed(rates: Sequence[float]) -> list[float]:
    """The rates up to the last position that ever accepted (suffix decoding's 32 positions are
    mostly zeros), keeping at least the first."""
    last = max((index for index, rate in enumerate(rates) if rate > 0), default=0)
    return list(rates[: last + 1])
