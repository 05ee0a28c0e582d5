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
    """Draw the chart of ``(title, rows)`` tables into ``path``; False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acceptance = [
        (f"{title}: {item.label}" if len(tables) > 1 else item.label, item.figures.acceptance.per_position)
        for title, rows in tables
        for item in rows
        if item.figures is not None and item.figures.acceptance is not None and item.concurrency == min(r.concurrency for r in rows)
    ]
    curves: dict[str, list[tuple[int, float]]] = {}
    for title, rows in tables:
        for item in rows:
            if item.figures is not None:
                key = f"{title}: {item.label}" if len(tables) > 1 else item.label
                curves.setdefault(key, []).append((item.concurrency, item.figures.output_throughput))
    curves = {key: sorted(points) for key, points in curves.items() if len(points) > 1}
    panels = [panel for panel, present in (("acceptance", acceptance), ("throughput", curves)) if present]
    if not panels:
        return False
    figure, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for axis, panel in zip(axes[0], panels, strict=True):
        if panel == "acceptance":
            width = 0.8 / len(acceptance)
            for index, (label, rates) in enumerate(acceptance):
                positions = [p + index * width for p in range(len(rates))]
                axis.bar(positions, rates, width=width, label=label)
            depth = max(len(rates) for _, rates in acceptance)
            axis.set_xticks([p + 0.4 - width / 2 for p in range(depth)], [str(p + 1) for p in range(depth)])
            axis.set_xlabel("draft position")
            axis.set_ylabel("acceptance rate")
            axis.set_ylim(0, 1)
            axis.set_title("Per-position acceptance")
        else:
            for label, points in curves.items():
                axis.plot([c for c, _ in points], [t for _, t in points], marker="o", label=label)
            axis.set_xlabel("concurrency")
            axis.set_ylabel("output tokens / s")
            axis.set_title("Throughput against concurrency")
        axis.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
