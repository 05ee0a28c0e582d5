"""Fixtures of the core tests: tiny model folders (config.json only), plugin managers built from
fake plugins, the test plugin distribution installed for real, and a runner for ``aphrodite``."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
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
def test_plugin_installed() -> str:
    """Install the sonar-test-plugin distribution (editable) into this environment once."""
    try:
        importlib.metadata.distribution("sonar-test-plugin")
    except importlib.metadata.PackageNotFoundError:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--no-build-isolation", "-e", str(TEST_PLUGIN_DIR)],
            check=True,
        )
        importlib.invalidate_caches()
    if importlib.util.find_spec("sonar_test_plugin") is None:
        # An editable install is put on the import path when an interpreter starts; this one started
        # before the install.
        sys.path.insert(0, str(TEST_PLUGIN_DIR / "src"))
    return "sonar-test-plugin"


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
def run_aphrodite(test_plugin_installed: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the installed ``aphrodite`` command with the test plugins loaded, offline."""

    def run(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
        """``env`` adds variables; a None value removes one (None for SONAR_PLUGINS loads all)."""
        environ: dict[str, str | None] = {**os.environ, "SONAR_PLUGINS": CLI_PLUGINS, "HF_HUB_OFFLINE": "1"}
        environ.pop("SONAR_TRACE_HOOKS", None)
        environ.update(env or {})
        return subprocess.run(
            [str(APHRODITE), *args],
            capture_output=True,
            text=True,
            env={key: value for key, value in environ.items() if value is not None},
            timeout=300,
            cwd=REPO,
        )

    return run
