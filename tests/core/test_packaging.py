"""A built wheel carries every file the code reads beside its modules: each data file in a
distribution's package folders is matched by its ``[tool.setuptools.package-data]`` patterns."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = [REPO, *sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))]
SKIPPED_SUFFIXES = {".py", ".pyc"}


def _package_roots(project: Path, config: dict) -> list[Path]:
    where = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("where", ["."])
    include = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("include")
    roots = []
    for base in where:
        for child in sorted((project / base).iterdir()):
            if (child / "__init__.py").is_file() and (include is None or any(fnmatch.fnmatch(child.name, p) for p in include)):
                roots.append(child)
    return roots


def _covered(path: Path, root_parent: Path, patterns: dict[str, list[str]]) -> bool:
    """Whether a package-data pattern of the package holding ``path`` (or of one above it) matches."""
    relative = path.relative_to(root_parent)
    for depth in range(len(relative.parts) - 1, 0, -1):
        package = ".".join(relative.parts[:depth])
        inside = "/".join(relative.parts[depth:])
        if any(fnmatch.fnmatch(inside, pattern) for pattern in patterns.get(package, [])):
            return True
    return False


@pytest.mark.parametrize("project", DISTRIBUTIONS, ids=lambda p: p.name)
def test_every_data_file_of_a_package_is_declared(project):
    config = tomllib.loads((project / "pyproject.toml").read_text())
    patterns = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    missing = []
    for root in _package_roots(project, config):
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix not in SKIPPED_SUFFIXES and "__pycache__" not in path.parts:
                if not _covered(path, root.parent, patterns):
                    missing.append(str(path.relative_to(project)))
    assert not missing, f"add these to [tool.setuptools.package-data] of {project.name}: {missing}"
