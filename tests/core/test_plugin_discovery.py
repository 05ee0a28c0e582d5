"""Discovery through real entry points: sonar-core's custom_class and the installed test plugin."""

from __future__ import annotations

import logging

import pytest

from sonar_core.config import TargetInfo, validate_speculative_config
from sonar_core.errors import ConfigError
from sonar_core.plugins import get_plugin_manager

ONLY_TEST_PLUGINS = {"SONAR_PLUGINS": "custom_class,sonar_test"}


@pytest.fixture
def manager(test_plugin_installed):
    return get_plugin_manager(environ=ONLY_TEST_PLUGINS)


def test_entry_points_register_methods_with_their_distribution(manager):
    registry = manager.method_registry
    echo = registry.resolve("echo_test")
    assert (echo.distribution, echo.version) == ("sonar-test-plugin", "0.3.1")
    assert registry.aliases_of("echo_test") == ("echo_alias", "echo_v0")
    assert registry.old_names_of("echo_test") == ("echo_v0",)
    custom = registry.resolve("custom_class")
    assert (custom.distribution, custom.version) == ("sonar-core", "0.1.0")
    assert manager.sources["sonar_test"].value == "sonar_test_plugin"


def test_all_plugins_load_without_an_allow_list(test_plugin_installed):
    registry = get_plugin_manager(environ={}).method_registry
    assert {"custom_class", "echo_test"} <= set(registry.names())


def test_allow_list_loads_only_the_named_plugins(test_plugin_installed):
    manager = get_plugin_manager(environ={"SONAR_PLUGINS": "sonar_test"})
    assert manager.method_registry.names() == ["echo_test"]
    assert "custom_class" in {source.name for source in manager.not_loaded}


def test_empty_allow_list_loads_nothing(test_plugin_installed):
    manager = get_plugin_manager(environ={"SONAR_PLUGINS": ""})
    assert manager.method_registry.names() == []


def test_method_left_out_by_the_allow_list_says_so(test_plugin_installed):
    manager = get_plugin_manager(environ={"SONAR_PLUGINS": "sonar_test"})
    with pytest.raises(ConfigError) as info:
        validate_speculative_config({"method": "custom_class", "custom_class": "x:Y", "num_speculative_tokens": 1},
                                    None, manager)
    assert "SONAR_PLUGINS allow-list leaves out its entry point 'custom_class'" in info.value.message


def test_a_third_party_method_left_out_by_the_allow_list_says_so(test_plugin_installed):
    """The test plugin's entry point is ``sonar_test``, its method ``echo_test``: the error names the
    left-out entry point and says the allow-list takes entry-point names."""
    manager = get_plugin_manager(environ={"SONAR_PLUGINS": "ngram"})
    with pytest.raises(ConfigError) as info:
        validate_speculative_config({"method": "echo_test", "num_speculative_tokens": 1}, None, manager)
    assert "SONAR_PLUGINS allow-list leaves out installed plugins that may provide it" in info.value.message
    assert "'sonar_test' (sonar-test-plugin)" in info.value.message
    assert "lists entry-point names, which need not equal method names" in info.value.fix
    assert "not a speculation method" not in info.value.message


def test_allow_list_naming_an_unknown_plugin_warns(test_plugin_installed, caplog):
    with caplog.at_level(logging.WARNING, logger="sonar.plugins"):
        get_plugin_manager(environ={"SONAR_PLUGINS": "sonar_test,sonar_tset"})
    assert any("sonar_tset" in record.getMessage() for record in caplog.records)


def test_installed_plugin_alias_and_options(manager):
    resolved = validate_speculative_config(
        {"method": "echo_alias", "num_speculative_tokens": 3, "repeat": 2}, None, manager
    )
    assert (resolved.method, resolved.options.repeat) == ("echo_test", 2)


def test_installed_plugin_alias_hook(manager):
    target = TargetInfo(("EchoForCausalLM",), "echo_family", 100, 256)
    resolved = validate_speculative_config({"method": "family_echo", "num_speculative_tokens": 2}, target, manager)
    assert resolved.method == "echo_test"


def test_installed_plugin_rules(manager):
    with pytest.raises(ConfigError) as info:
        validate_speculative_config({"method": "echo_test", "num_speculative_tokens": 9}, None, manager)
    assert info.value.field == "speculative_config.num_speculative_tokens"
    resolved = validate_speculative_config({"method": "echo_test", "num_speculative_tokens": 5}, None, manager)
    assert resolved.warnings == ("echo_test: num_speculative_tokens=5 is deep for this method",)


def test_installed_plugin_options_reject_unknown_keys(manager):
    with pytest.raises(ConfigError) as info:
        validate_speculative_config({"method": "echo_test", "num_speculative_tokens": 2, "repeats": 2}, None, manager)
    assert "not an option of method 'echo_test'" in info.value.message
    assert "did you mean 'repeat'?" in info.value.fix


def test_installed_plugin_builds_its_proposer(manager):
    from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, ProposerContext

    resolved = validate_speculative_config({"method": "echo_test", "num_speculative_tokens": 3, "repeat": 2},
                                           None, manager)
    context = ProposerContext(
        speculative_config=resolved.config, method_options=resolved.options, target_model=None,
        target_hf_config=None, target_tokenizer=None, dtype=None, device=None, max_model_len=256,
    )
    proposer = manager.create_proposer(resolved, context)
    request = ProposalRequest(request_id="r", token_ids=[5, 6, 7], num_new_tokens=3, max_draft_tokens=3, block_table=[0])
    batch = ProposeBatch(requests=[request], block_size=16, kv_caches=[], device=None)
    assert proposer.propose(batch).token_ids == [[7, 7]]
