"""``aphrodite plugins``: the installed speculation methods, their aliases and their packages."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from typing import Any

from sonar_core.plugins import MTP_LEGACY_METHOD_NAMES, SONAR_METHOD_PACKAGES, get_plugin_manager

NAME = "plugins"
_COLUMNS = ("METHOD", "ALIASES", "DISTRIBUTION", "VERSION", "DESCRIPTION")
# Widest a column may get before its text wraps onto more lines.
_WIDTHS = (22, 36, 22, 10, 48)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="List the installed speculation methods and the packages that provide them.",
        description="List the speculation methods found through the 'sonar' entry points (restricted by "
        "SONAR_PLUGINS when set), with their aliases, distribution and version.",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    return parser


def run(args: argparse.Namespace) -> int:
    manager = get_plugin_manager()
    registry = manager.method_registry
    rows = [
        {
            "method": spec.name,
            "aliases": list(registry.aliases_of(spec.name)),
            "distribution": spec.distribution,
            "version": spec.version,
            "description": spec.description,
        }
        for spec in registry.methods()
    ]
    # Sonar's methods whose package is absent (not merely left out by the allow-list).
    missing = {
        method: package
        for method, package in SONAR_METHOD_PACKAGES.items()
        if method not in registry
        and method not in MTP_LEGACY_METHOD_NAMES
        and package not in registry.not_loaded
        and package not in registry.failed
    }
    not_loaded = [
        {"entry_point": source.name, "distribution": source.distribution, "version": source.version}
        for source in manager.not_loaded
    ]
    failed = [
        {"entry_point": source.name, "distribution": source.distribution, "version": source.version, "error": error}
        for source, error in manager.failed
    ]
    # A plugin that does not load is a broken installation: say so in the exit status too.
    status = 1 if failed else 0
    if args.json:
        print(json.dumps({"methods": rows, "not_installed": missing, "not_loaded": not_loaded, "failed": failed}, indent=2))
        return status
    if rows:
        table = [[row["method"], ", ".join(row["aliases"]), row["distribution"], row["version"], row["description"]]
                 for row in rows]
        print(render_table(_COLUMNS, table, _WIDTHS))
    else:
        print("No speculation methods are installed.")
    if not_loaded:
        names = ", ".join(f"{item['entry_point']} ({item['distribution']} {item['version']})" for item in not_loaded)
        print(f"\nInstalled but not loaded (SONAR_PLUGINS): {names}")
    if failed:
        print("\nInstalled but failed to load (fix: pip install --force-reinstall DISTRIBUTION):")
        for item in failed:
            print(f"  {item['entry_point']} ({item['distribution']} {item['version']}): {item['error']}")
    if missing:
        by_package: dict[str, list[str]] = {}
        for method, package in missing.items():
            by_package.setdefault(package, []).append(method)
        print("\nSonar methods not installed:")
        for package, methods in by_package.items():
            print(f"  {', '.join(methods)}: pip install {package}")
    return status


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], max_widths: Sequence[int]) -> str:
    """A plain-text table; cells longer than their column's maximum width wrap onto more lines."""
    widths = [
        min(max_width, max(len(header[col]), *(len(row[col]) for row in rows)))
        for col, max_width in enumerate(max_widths)
    ]
    lines = []
    for row in [list(header), *rows]:
        cells = [textwrap.wrap(text, width, break_on_hyphens=False) or [""] for text, width in zip(row, widths, strict=True)]
        for depth in range(max(len(cell) for cell in cells)):
            parts = [(cell[depth] if depth < len(cell) else "").ljust(width) for cell, width in zip(cells, widths, strict=True)]
            lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
