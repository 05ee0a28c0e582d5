"""The plugin as the engine meets it: entry point, registration, configuration rules, factories."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from sonar_ngram import plugin
from sonar_ngram.proposer import NgramGPUProposer, NgramProposer

from sonar_core.config import SpeculativeConfig, validate_speculative_config
from sonar_core.errors import ConfigError
from sonar_core.plugins import SonarPluginManager, get_plugin_manager
from sonar_core.spec_decode.prompt_lookup import LookupBounds, resolve_lookup_bounds
from sonar_core.spec_decode.proposer import ProposerContext

METHODS = ["ngram", "ngram_gpu"]


@pytest.fixture(scope="module")
def manager() -> SonarPluginManager:
    # Only this distribution's entry point, so the tests do not depend on other installed plugins.
    return get_plugin_manager(environ={"SONAR_PLUGINS": "ngram"})


def validate(manager: SonarPluginManager, **fields: Any):
    return validate_speculative_config({"num_speculative_tokens": 4, **fields}, None, manager)


def test_entry_point_belongs_to_the_distribution() -> None:
    (found,) = [ep for ep in entry_points(group="sonar") if ep.name == "ngram"]
    assert found.value == "sonar_ngram.plugin"
    assert found.dist is not None and found.dist.metadata["Name"] == "sonar-ngram"


def test_methods_are_registered_with_their_distribution(manager: SonarPluginManager) -> None:
    registry = manager.method_registry
    for name in METHODS:
        spec = registry.resolve(name)
        assert spec.distribution == "sonar-ngram" and spec.options_model is plugin.NgramOptions
    assert registry.canonical_name("[ngram]") == "ngram"


def test_vllm_defaults() -> None:
    assert resolve_lookup_bounds(None, None) == LookupBounds(5, 5)
    assert resolve_lookup_bounds(None, 3) == LookupBounds(3, 3)
    assert resolve_lookup_bounds(2, None) == LookupBounds(2, 2)
    assert resolve_lookup_bounds(2, 4) == LookupBounds(2, 4)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"prompt_lookup_min": 2, "prompt_lookup_max": 5},
        {"prompt_lookup_min": 7},
        {"prompt_lookup_max": 1},
    ],
)
def test_valid_configurations(manager: SonarPluginManager, method: str, fields: dict[str, int]) -> None:
    resolved = validate(manager, method=method, **fields)
    assert resolved.method == method and resolved.warnings == ()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("field", ["prompt_lookup_min", "prompt_lookup_max"])
@pytest.mark.parametrize("value", [0, -3])
def test_bounds_must_be_positive(manager: SonarPluginManager, method: str, field: str, value: int) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(manager, method=method, **{field: value})
    assert caught.value.field == f"speculative_config.{field}"
    assert "1 or more" in caught.value.fix


@pytest.mark.parametrize("method", METHODS)
def test_min_above_max(manager: SonarPluginManager, method: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(manager, method=method, prompt_lookup_min=4, prompt_lookup_max=2)
    assert caught.value.field == "speculative_config.prompt_lookup_min"
    assert "at most 2" in caught.value.fix


@pytest.mark.parametrize("method", METHODS)
def test_a_checkpoint_is_rejected(manager: SonarPluginManager, method: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(manager, method=method, model="Qwen/Qwen3-0.6B")
    assert caught.value.field == "speculative_config.model"
    assert "remove 'model'" in caught.value.fix


def test_the_legacy_model_spelling_is_accepted(manager: SonarPluginManager) -> None:
    assert validate(manager, method="ngram", model="[ngram]").method == "ngram"


def test_all_problems_are_reported_together(manager: SonarPluginManager) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(manager, method="ngram", prompt_lookup_min=0, prompt_lookup_max=0, model="x")
    fields = [caught.value.field, *(error.field for error in caught.value.also)]
    assert fields == [
        "speculative_config.prompt_lookup_min",
        "speculative_config.prompt_lookup_max",
        "speculative_config.model",
    ]


@pytest.mark.parametrize("method", METHODS)
def test_probabilistic_drafting_warns(manager: SonarPluginManager, method: str) -> None:
    resolved = validate(manager, method=method, draft_sample_method="probabilistic")
    assert any("one-hot" in warning and method in warning for warning in resolved.warnings)


@pytest.mark.parametrize("method", METHODS)
def test_a_misspelt_key_names_the_key_and_the_method(manager: SonarPluginManager, method: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(manager, method=method, prompt_lookup_maxx=3)
    assert caught.value.field == "speculative_config.prompt_lookup_maxx"
    assert repr(method) in caught.value.message
    assert "prompt_lookup_max" in caught.value.fix


def test_other_methods_are_left_alone() -> None:
    config = SpeculativeConfig(method="eagle3", model="some/head", prompt_lookup_min=0)
    assert plugin.sonar_validate_speculative_config(config=config, target=None) is None


def context_for(config: SpeculativeConfig) -> ProposerContext:
    return ProposerContext(
        speculative_config=config,
        method_options=None,
        target_model=torch.nn.Identity(),
        target_hf_config=None,
        target_tokenizer=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=2048,
    )


@pytest.mark.parametrize(("method", "kind"), [("ngram", NgramProposer), ("ngram_gpu", NgramGPUProposer)])
def test_factories_read_the_configuration(manager: SonarPluginManager, method: str, kind: type) -> None:
    resolved = validate(manager, method=method, prompt_lookup_max=3)
    proposer = manager.create_proposer(resolved, context_for(resolved.config))
    assert isinstance(proposer, kind)
    assert proposer.bounds == LookupBounds(3, 3)
    assert not proposer.capabilities.returns_draft_probs and not proposer.capabilities.kv_layers
    assert not proposer.capabilities.target_hidden_layers
    if isinstance(proposer, NgramGPUProposer):
        assert proposer.num_speculative_tokens == 4 and proposer.device == torch.device("cpu")
