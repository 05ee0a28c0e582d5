"""Fixtures of the core tests: tiny model folders (config.json only), plugin managers built from
fake plugins, the test plugin distribution installed for real, and a runner for ``aphrodite``."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_fakes import fake_source

from sonar_core.plugins import SonarPluginManager, get_plugin_manager

REPO = Path(__file__).resolve().parents[2]
TEST_PLUGIN_DIR = REPO / "tests" / "fixtures" / "sonar-test-plugin"
APHRODITE = Path(sys.executable).parent / "aphrodite"
# The plugins the command-line tests load: Sonar's builtin method and the test plugin, so that the
# results do not depend on which other plugins this environment has.
CLI_PLUGINS = "custom_class,sonar_test"


@pytest.fixture(scope="session")
def test_plugin_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Install the sonar-test-plugin distribution into a throw-away folder, never into the user's
    environment: the folder goes on this interpreter's import path (its entry points are found
    from there) and on ``PYTHONPATH`` for the commands ``run_aphrodite`` starts. Returns the folder."""
    site = tmp_path_factory.mktemp("test-plugin-site")
    source = tmp_path_factory.mktemp("test-plugin-source") / TEST_PLUGIN_DIR.name
    shutil.copytree(TEST_PLUGIN_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--target", str(site), str(source)],
        check=True,
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def _no_plugin_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without an allow-list or tracing from the caller's environment."""
    for name in ("SONAR_PLUGINS", "SONAR_TRACE_HOOKS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_model_dir(tmp_path: Path) -> Callable[..., Path]:
    """A folder holding only config.json (what validation reads), with overridable keys."""

    def make(name: str = "target", **overrides: Any) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 256,
            "max_position_embeddings": 512,
            **overrides,
        }
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return make


@pytest.fixture
def manager_with() -> Callable[..., SonarPluginManager]:
    """A plugin manager with only the given fake plugins (no entry points)."""

    def build(*plugins: object) -> SonarPluginManager:
        sources = [(plugin, fake_source(getattr(plugin, "name", f"plugin{index}"))) for index, plugin in enumerate(plugins)]
        return get_plugin_manager(load_entry_points=False, plugins=sources)

    return build


@pytest.fixture
def run_aphrodite(test_plugin_installed: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the installed ``aphrodite`` command with the test plugins loaded, offline."""

    def run(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
        """``env`` adds variables; a None value removes one (None for SONAR_PLUGINS loads all). A
        ``PYTHONPATH`` given is put in front of the test plugin's folder."""
        environ: dict[str, str | None] = {**os.environ, "SONAR_PLUGINS": CLI_PLUGINS, "HF_HUB_OFFLINE": "1"}
        environ.pop("SONAR_TRACE_HOOKS", None)
        environ.update(env or {})
        paths = [environ.get("PYTHONPATH"), str(test_plugin_installed)]
        environ["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
        return subprocess.run(
            [str(APHRODITE), *args],
            capture_output=True,
            text=True,
            env={key: value for key, value in environ.items() if value is not None},
            timeout=300,
            cwd=REPO,
        )

    return run
