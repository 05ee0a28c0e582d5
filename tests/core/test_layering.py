"""The layers of docs/architecture (DESIGN section 9) hold: no module imports a layer above its own.

From the top: training > entrypoints > engine > {spec_decode contract, plugins} > models > layers > kv;
config imports neither plugins nor models; plugins import the contract, never the engine. Every
import counts, including those inside functions and under ``TYPE_CHECKING``: a ring hidden that
way is still a ring.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "sonar_core"

# Rank of each top-level part of sonar_core: a module may import its own part and lower ranks.
RANKS: dict[str, int] = {
    "training": 8,
    "entrypoints": 7, "bench": 7, "testing": 7, "parallel": 7,
    "engine": 6,
    "spec_decode": 5, "plugins": 5, "builtin_methods": 5,
    "models": 4,
    "layers": 3, "sample": 3,
    "kv": 2,
    "config": 1, "cpu_kernels": 1,
    "errors": 0, "sampling_params": 0, "outputs": 0, "model_files": 0, "hub": 0, "cpu_usage": 0, "cpu_features": 0, "attention_backends": 0,
    "__init__": 0,
}
# Imports between different parts of the same rank that the design allows (importer, imported).
SAME_RANK_ALLOWED = {
    ("plugins", "spec_decode"),          # hook specs name the proposer contract
    ("builtin_methods", "plugins"),      # custom_class is a plugin
    ("builtin_methods", "spec_decode"),
    ("entrypoints", "bench"),            # the bench command
    ("entrypoints", "parallel"),         # the server runs data-parallel replicas
    ("bench", "entrypoints"),            # the bench drives the CLI and the LLM class
    ("bench", "testing"),                # truncated drafts and random heads for benchmark rows
    ("testing", "entrypoints"),          # the test kit checks losslessness through the LLM class
    ("model_files", "hub"),              # repository ids resolve through the Hub client
    ("hub", "errors"),
}
# Imports of a higher part by one named module (importer module, imported part): the trainer sits
# above everything it drives, and only its command reaches up to it.
MODULE_ALLOWED = {
    ("sonar_core.entrypoints.commands.train_draft", "training"),
}
# What a method plugin (plugins/*/src) may import from sonar_core: the contract and below.
PLUGIN_FORBIDDEN = ("engine", "entrypoints", "bench", "training")


def _part(module: str) -> str:
    """``sonar_core.engine.scheduler`` -> ``engine``; ``sonar_core`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every ``sonar_core`` module that ``path`` imports, with the line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "sonar_core":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "sonar_core":
                continue
            if name == "sonar_core":  # from sonar_core import engine
                for alias in node.names:
                    yield f"sonar_core.{alias.name}", node.lineno
            else:
                yield name, node.lineno


def _core_modules() -> list[tuple[Path, str]]:
    modules = []
    for path in sorted(CORE.rglob("*.py")):
        relative = path.relative_to(REPO).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append((path, ".".join(parts)))
    return modules


def test_every_part_of_sonar_core_has_a_rank():
    parts = {_part(module) for _, module in _core_modules()}
    assert parts <= set(RANKS), f"give these parts a rank: {sorted(parts - set(RANKS))}"


def test_no_module_imports_a_higher_layer():
    violations = []
    for path, module in _core_modules():
        mine = _part(module)
        for imported, line in _imports(path, module):
            theirs = _part(imported)
            if theirs == mine or theirs not in RANKS or (module, theirs) in MODULE_ALLOWED:
                continue
            if RANKS[theirs] > RANKS[mine] or (
                RANKS[theirs] == RANKS[mine] and (mine, theirs) not in SAME_RANK_ALLOWED
            ):
                violations.append(f"{path.relative_to(REPO)}:{line}: {mine} imports {imported}")
    assert not violations, "layering violated:\n" + "\n".join(violations)


@pytest.mark.parametrize("plugin_src", sorted(p for p in (REPO / "plugins").glob("*/src") if p.is_dir()),
                         ids=lambda p: p.parent.name)
def test_plugins_import_the_contract_never_the_engine(plugin_src: Path):
    violations = []
    for path in sorted(plugin_src.rglob("*.py")):
        for imported, line in _imports(path, "plugin.module"):
            if _part(imported) in PLUGIN_FORBIDDEN:
                violations.append(f"{path.relative_to(REPO)}:{line}: imports {imported}")
    assert not violations, "a plugin reaches past the contract:\n" + "\n".join(violations)


def test_the_check_sees_imports_inside_functions_and_type_checking(tmp_path: Path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from sonar_core.engine.sequence import Sequence\n"
        "def f():\n    from sonar_core.plugins import manager\n"
        "from . import rules\n"
    )
    found = {name for name, _ in _imports(source, "sonar_core.config.probe")}
    assert found == {"sonar_core.engine.sequence", "sonar_core.plugins", "sonar_core.config"}
