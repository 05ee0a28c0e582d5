"""Suites: saved lists of ``aphrodite bench`` runs, so that one command reproduces a whole report.

A suite is a JSON file: ``{"description": "...", "runs": [{"title": "...", "args": ["offline",
"--workload", "chat", ...]}, ...]}``; each run's ``args`` are what would follow ``aphrodite bench``.
Shipped suites live in ``suites/`` next to this module and are named without ``.json``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from sonar_core.errors import ConfigError

SUITE_DIR = Path(__file__).resolve().parent / "suites"


def load_suite(name_or_path: str) -> tuple[str, dict[str, Any]]:
    """The suite's name and content; a ConfigError names the shipped suites."""
    shipped = {path.stem: path for path in sorted(SUITE_DIR.glob("*.json"))}
    path = shipped.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError("suite", f"no suite named {name_or_path!r}", f"use one of {', '.join(shipped)} or a JSON file")
    try:
        suite = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError("suite", f"{path} is not JSON: {exc.msg} at line {exc.lineno}", "fix the file") from None
    runs = suite.get("runs") if isinstance(suite, dict) else None
    if not isinstance(runs, list) or not runs or not all(isinstance(run.get("args"), list) for run in runs):
        raise ConfigError("suite", f"{path} has no list of runs with 'args'", 'write {"runs": [{"args": [...]}]}')
    return path.stem, suite


def run_suite(name_or_path: str, out_dir: Path, show_progress: bool = True, only: list[int] | None = None) -> int:
    """Run every entry of the suite in order (or the entries numbered in ``only``, from 1), and
    write ``out_dir/NAME.{md,json,png}``."""
    from sonar_core.bench import session
    from sonar_core.bench.chart import matplotlib_available, write_chart
    from sonar_core.bench.report import render, to_json, write_json
    from sonar_core.entrypoints.cli import build_parser

    name, suite = load_suite(name_or_path)
    count = len(suite["runs"])
    if only and not all(1 <= number <= count for number in only):
        raise ConfigError("only", f"{name} has runs 1 to {count}", f"pass --only with numbers from 1 to {count}")
    parser = build_parser()
    parsed = []
    for index, entry in enumerate(suite["runs"]):
        if only and index + 1 not in only:
            continue
        args = parser.parse_args(["bench", *entry["args"]])
        if args.bench_mode not in ("offline", "serve"):
            raise ConfigError("suite", f"run {index + 1} of {name} is a {args.bench_mode!r} run", "use offline or serve")
        args.title = entry.get("title") or args.title
        args.command_line = "aphrodite bench " + shlex.join(entry["args"])
        parsed.append(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = f"aphrodite bench suite {name_or_path}" + (f" --only {' '.join(map(str, only))}" if only else "")
    if only:
        name = f"{name}-only-{'-'.join(map(str, only))}"  # a partial report never replaces the whole one
    header = f"# {suite.get('description', name)}\n\nReproduce with: `{command}`\n\n"
    markdown, json_path = out_dir / f"{name}.md", out_dir / f"{name}.json"
    tables = []
    for args in parsed:
        bench = session.bench_offline if args.bench_mode == "offline" else session.bench_serve
        new = bench(args, show_progress=show_progress)
        for table in new:
            print(render(table.meta, table.results) + "\n", flush=True)
        tables += new
        # Written after every run, so that an interrupted suite keeps what it measured.
        sections = [f"{render(t.meta, t.results)}\n\nCommand: `{t.meta.command}`" for t in tables]
        markdown.write_text(header + "\n\n".join(sections) + "\n", encoding="utf-8")
        write_json(json_path, [to_json(t.meta, t.results) for t in tables])
    print(f"Markdown: {markdown}\nJSON: {json_path}")
    if matplotlib_available() and write_chart(out_dir / f"{name}.png", [(t.meta.title, t.results) for t in tables]):
        print(f"Chart: {out_dir / f'{name}.png'}")
    return 0
