"""Tables (Markdown, readable in a terminal and pasteable into docs) and JSON of benchmark rows."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sonar_core.bench.figures import Distribution, e2e, ttft
from sonar_core.bench.results import RowResult
from sonar_core.cpu_features import cpu_model, kernel_flags

MIB = 1 << 20
COLUMNS = (
    "row", "precision", "conc", "TTFT ms p50/p90", "ITL ms p50/p90", "E2E s p50/p90", "req/s", "tok/s",
    "speedup", "vs Sonar", "peak RSS MiB", "KV MiB", "accept len", "tok/step", "accept by position", "draft cost",
    "= plain", "= Sonar", "other CPU",
)


@dataclass
class TableMeta:
    """What a table was measured on, printed above it and stored with the JSON."""

    title: str
    workload: str
    num_prompts: int
    max_tokens: int
    threads: int
    request_rate: float
    command: str
    machine: str = field(default_factory=lambda: machine_description())
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None


def machine_description() -> str:
    """CPU model, core count and kernel-relevant instruction sets (the figures mean little
    without them: an AVX2-only machine and one with AMX run different kernels)."""
    flags = kernel_flags()
    return f"{cpu_model()}, {os.cpu_count()} cores" + (f" ({', '.join(flags)})" if flags else "")


def _ms(dist: Distribution) -> str:
    return f"{dist.p50 * 1000:.0f} / {dist.p90 * 1000:.0f}" if dist.count else "–"


def _ms_fine(dist: Distribution) -> str:
    return f"{dist.p50 * 1000:.1f} / {dist.p90 * 1000:.1f}" if dist.count else "–"


def _s(dist: Distribution) -> str:
    return f"{dist.p50:.2f} / {dist.p90:.2f}" if dist.count else "–"


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{value:.{digits}f}{suffix}"


def _ratio(value: float | None, unreliable: bool) -> str:
    """A ratio, marked ``?`` when a row it compares is unreliable (see RowResult.unreliable)."""
    text = _num(value, 2, "x")
    return f"{text}?" if unreliable and text != "–" else text


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / MIB:.0f}"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f}%"


def row_cells(item: RowResult) -> list[str]:
    precision = item.result.precision if item.result is not None else "–"
    head = [item.label, precision, str(item.concurrency)]
    figures = item.figures
    if figures is None:
        return head + ["not run (see below)"] + [""] * (len(COLUMNS) - len(head) - 1)
    acceptance = figures.acceptance
    return head + [
        _ms(figures.ttft),
        _ms_fine(figures.itl),
        _s(figures.e2e),
        _num(figures.request_throughput, 3),
        _num(figures.output_throughput, 1),
        _ratio(figures.speedup, figures.speedup_unreliable),
        _ratio(figures.vs_sonar, figures.vs_sonar_unreliable),
        _mib(figures.peak_rss_bytes if figures.peak_device_bytes is None else figures.peak_device_bytes),
        _mib(figures.kv_cache_bytes),
        _num(acceptance.mean_acceptance_length) if acceptance else "–",
        _num(figures.tokens_per_step),
        " ".join(f"{rate:.2f}" for rate in acceptance.per_position) if acceptance else "–",
        _percent(figures.draft_cost),
        _percent(figures.match_plain),
        _percent(figures.match_sonar),
        _num(item.other_cpu, 1),
    ]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table padded to align in a terminal too."""
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def render(meta: TableMeta, results: Sequence[RowResult]) -> str:
    """One table with its heading: what was run, on what, and how loaded the machine was."""
    rate = "as fast as the concurrency allows" if meta.request_rate == float("inf") else f"{meta.request_rate:g} req/s"
    lines = [
        f"### {meta.title}",
        "",
        f"Workload `{meta.workload}`, {meta.num_prompts} prompts, greedy, at most {meta.max_tokens} new tokens, "
        f"{meta.threads} threads, arrivals: {rate}. Machine: {meta.machine}.",
    ]
    if meta.load_before is not None and meta.load_after is not None:
        lines.append(
            f"Load average (1 min) before / after: {meta.load_before[0]:.2f} / {meta.load_after[0]:.2f}."
        )
    lines += ["", markdown_table(COLUMNS, [row_cells(item) for item in results])]
    notes = _notes(results)
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines)


def _notes(results: Sequence[RowResult]) -> list[str]:
    """Each distinct note once, with the rows it applies to; why skipped rows did not run."""
    by_note: dict[str, list[str]] = {}
    for item in results:
        notes = list(item.figures.notes) if item.figures is not None else [f"not run: {item.skipped}"]
        if item.attempts > 1:
            notes.append(f"measured {item.attempts} times because other work was running; the quietest attempt is shown")
        if len(item.pass_throughputs) > 1:
            spread = ", ".join(f"{value:.1f}" for value in item.pass_throughputs)
            notes.append(f"fastest of {len(item.pass_throughputs)} passes (output tok/s per pass: {spread})")
        if item.quiet is False:
            notes.append("other work kept the machine busy in every attempt: these figures are less reliable")
        if item.unreliable:
            notes.append(f"unreliable: {item.unreliable}; a ratio marked ? involves it and is not a measured speedup")
        for note in notes:
            labels = by_note.setdefault(note, [])
            if item.label not in labels:
                labels.append(item.label)
    lines = [f"{', '.join(labels)}: {note}" for note, labels in by_note.items()]
    if any(_differs_from_plain(item) for item in results):
        lines.append(
            "= plain: the share of requests whose output equals the plain row's token for token. Below 100% in "
            "bfloat16 or float16 is expected: verifying several tokens in one pass rounds differently from one "
            "token at a time, so a near-tie can go the other way and the outputs part from there (the normal "
            "numerical differences of speculative decoding); in float32 they are equal (tested)."
        )
    return lines


def _differs_from_plain(item: RowResult) -> bool:
    figures = item.figures
    return figures is not None and figures.match_plain is not None and figures.match_plain < 1.0


def to_json(meta: TableMeta, results: Sequence[RowResult]) -> dict[str, Any]:
    """Every number of a table, and each request's own timings, as plain JSON (NaN as null)."""
    rows = []
    for item in results:
        entry: dict[str, Any] = {
            "label": item.label,
            "engine": item.row.engine,
            "method": item.row.method,
            "options": item.row.options,
            "concurrency": item.concurrency,
            "skipped": item.skipped,
            "other_cpu": item.other_cpu,
            "attempts": item.attempts,
            "quiet": item.quiet,
            "pass_throughputs": item.pass_throughputs,
        }
        if item.result is not None and item.figures is not None:
            entry["engine_version"] = item.result.engine_version
            entry["precision"] = item.result.precision
            entry["figures"] = asdict(item.figures)
            entry["requests"] = [
                {"id": r.id, "ttft_s": ttft(r), "e2e_s": e2e(r), "output_tokens": sum(n for _, n in r.events)}
                for r in item.result.requests
            ]
            entry["rss_after_load_bytes"] = item.result.rss_after_load_bytes
        rows.append(entry)
    meta_json = asdict(meta)
    if meta.request_rate == float("inf"):
        meta_json["request_rate"] = None
    return _finite({"meta": meta_json, "rows": rows})


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def write_json(path: Path, tables: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tables": list(tables)}, indent=2) + "\n", encoding="utf-8")
