"""Configuration of the suffix method: registration, options, their errors, and a missing arctic-inference."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sonar_suffix.options import SuffixOptions

from sonar_core.config import validate_speculative_config
from sonar_core.errors import ConfigError
from sonar_core.plugins import get_plugin_manager

BASE = {"method": "suffix", "num_speculative_tokens": 8}
# Only this distribution's entry point: the tests do not depend on other plugins loading.
ONLY_SUFFIX = {"SONAR_PLUGINS": "suffix"}


@pytest.fixture(scope="module")
def plugin_manager():
    return get_plugin_manager(environ=ONLY_SUFFIX)


def validate(plugin_manager, **fields):
    return validate_speculative_config({**BASE, **fields}, None, plugin_manager, log_warnings=False)


def test_suffix_is_registered_from_the_installed_distribution(plugin_manager) -> None:
    spec = plugin_manager.method_registry.get("suffix")
    assert spec is not None
    assert spec.distribution == "sonar-suffix"
    assert spec.options_model is SuffixOptions


def test_the_documented_configuration_validates_with_vllm_defaults(plugin_manager) -> None:
    resolved = validate(plugin_manager, num_speculative_tokens=32)
    assert resolved.method == "suffix"
    assert resolved.num_speculative_tokens == 32
    assert resolved.warnings == ()
    assert resolved.options == SuffixOptions(
        suffix_decoding_max_tree_depth=24,
        suffix_decoding_max_cached_requests=10000,
        suffix_decoding_max_spec_factor=1.0,
        suffix_decoding_min_token_prob=0.1,
    )


def test_options_are_passed_through(plugin_manager) -> None:
    resolved = validate(
        plugin_manager,
        suffix_decoding_max_tree_depth=64,
        suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_spec_factor=2,
        suffix_decoding_min_token_prob=0.0,
    )
    assert resolved.options == SuffixOptions(
        suffix_decoding_max_tree_depth=64,
        suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_spec_factor=2.0,
        suffix_decoding_min_token_prob=0.0,
    )


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("suffix_decoding_max_tree_depth", 0, "at least 1"),
        ("suffix_decoding_max_tree_depth", True, "whole number"),
        ("suffix_decoding_max_tree_depth", "24", "whole number"),
        ("suffix_decoding_max_tree_depth", 2.5, "whole number"),
        ("suffix_decoding_max_cached_requests", -1, "cannot be negative"),
        ("suffix_decoding_max_cached_requests", 2**31, "at most 2147483647"),
        ("suffix_decoding_max_spec_factor", -0.5, "0 or more"),
        ("suffix_decoding_max_spec_factor", float("inf"), "finite"),
        ("suffix_decoding_min_token_prob", 1.5, "between 0 and 1"),
        ("suffix_decoding_min_token_prob", -0.1, "between 0 and 1"),
    ],
)
def test_bad_option_values_name_the_field_and_the_fix(plugin_manager, field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError) as raised:
        validate(plugin_manager, **{field: value})
    error = raised.value
    assert error.field == f"speculative_config.{field}"
    assert words in str(error)
    assert "Fix:" in str(error)


def test_a_misspelt_option_suggests_the_right_name(plugin_manager) -> None:
    with pytest.raises(ConfigError) as raised:
        validate(plugin_manager, suffix_decoding_max_tree_dept=12)
    assert raised.value.field == "speculative_config.suffix_decoding_max_tree_dept"
    assert "did you mean 'suffix_decoding_max_tree_depth'" in raised.value.fix


def test_a_checkpoint_is_refused(plugin_manager) -> None:
    with pytest.raises(ConfigError) as raised:
        validate(plugin_manager, model="some/draft")
    assert raised.value.field == "speculative_config.model"
    assert "remove 'model'" in raised.value.fix


def test_fields_without_effect_give_warnings(plugin_manager) -> None:
    resolved = validate(plugin_manager, prompt_lookup_min=2, draft_sample_method="probabilistic")
    assert len(resolved.warnings) == 2
    assert "prompt_lookup_min has no effect with method 'suffix'" in resolved.warnings[0]
    assert "probabilistic" in resolved.warnings[1]


def test_missing_arctic_inference_is_a_config_error_with_the_install_command(
    plugin_manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes the import fail exactly as an absent package does.
    monkeypatch.setitem(sys.modules, "arctic_inference", None)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ConfigError) as raised:
        validate(plugin_manager)
    error = raised.value
    assert error.field == "speculative_config.method"
    assert "arctic_inference.suffix_decoding cannot be imported" in error.message
    assert "pip install -e plugins/sonar-suffix" in error.fix
    assert "PIP_CONSTRAINT=constraints.txt pip install -e plugins/sonar-suffix" in error.fix
    assert "torch==2." in error.fix


def test_loading_the_plugin_imports_neither_arctic_inference_nor_the_proposer() -> None:
    code = (
        "import sys\n"
        "from sonar_core.plugins import get_plugin_manager\n"
        f"assert 'suffix' in get_plugin_manager(environ={ONLY_SUFFIX!r}).method_registry\n"
        "print(sorted(m for m in ('arctic_inference', 'sonar_suffix.proposer') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
