"""The documentation stays true: every hook is documented and tested, every test that the rule
table of docs/configuration.md names exists, and every link between the documents leads somewhere."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from sonar_core.plugins import hookspecs

REPO = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name in vars(hookspecs) if name.startswith("sonar_"))
RULE_TABLE = (REPO / "docs" / "configuration.md").read_text().split("## Rules and the tests that cover them")[1]
TEST_REFERENCES = sorted(set(re.findall(r"`([\w/.-]+\.py)::(\w+)`", RULE_TABLE)))


def test_there_are_hooks_and_references():
    assert len(HOOKS) == 7
    assert len(TEST_REFERENCES) > 50


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    assert f"### {hook}\n" in (REPO / "docs" / "plugins.md").read_text()
    assert getattr(hookspecs, hook).__doc__


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_exercised_by_a_core_test(hook):
    # The test modules and their fake plugins (which implement the hooks the tests drive).
    tests = [path for path in Path(__file__).parent.glob("*.py") if path.name != Path(__file__).name]
    assert any(hook in path.read_text() for path in tests)


@pytest.mark.parametrize(("path", "name"), TEST_REFERENCES)
def test_every_test_named_in_the_rule_table_exists(path, name):
    source = REPO / path
    assert source.is_file(), path
    assert re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE), f"{path}::{name}"


def test_the_supported_model_table_is_generated_from_the_registry():
    from sonar_core.entrypoints.commands.plugins import supported_models_markdown
    from sonar_core.plugins import get_plugin_manager

    registry = get_plugin_manager(environ={}).method_registry
    documented = (REPO / "docs" / "supported-models.md").read_text()
    assert documented == supported_models_markdown(registry), (
        "docs/supported-models.md is stale: regenerate it with `aphrodite plugins --models --markdown`"
    )


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("plugins/*/README.md"))]


@functools.cache
def _prose(document: Path) -> str:
    """A Markdown document without its code blocks (a ``#`` line there is no heading, a ``](``
    no link)."""
    return re.sub(r"```.*?```", "", document.read_text(), flags=re.DOTALL)


@functools.cache
def _heading_anchors(document: Path) -> frozenset[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces to
    hyphens."""
    return frozenset(
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", _prose(document), re.MULTILINE)
    )


@pytest.mark.parametrize("document", _markdown_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_inside_the_repository_leads_somewhere(document):
    broken = []
    for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", _prose(document)):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        linked = (document.parent / target).resolve() if target else document
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _heading_anchors(linked):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{document.name} links to what is not there: {broken}"
