"""The plugin manager with fake plugins: duplicates, misspelt hooks, tracing, proposer creation."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from plugin_fakes import FakeMethodPlugin, fake_source

from sonar_core.config import validate_speculative_config
from sonar_core.errors import DuplicateMethodError, PluginError
from sonar_core.plugins import (
    PluginSource,
    build_method_registry,
    enable_hook_tracing,
    get_plugin_manager,
    hookimpl,
)
from sonar_core.spec_decode.proposer import DraftProposal, Proposer


class StubProposer(Proposer):
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def propose(self, batch):
        return DraftProposal(token_ids=[[] for _ in batch.requests])


def manager(*plugins_and_sources):
    return get_plugin_manager(load_entry_points=False, plugins=plugins_and_sources)


def test_duplicate_method_from_two_distributions_names_both():
    first = (FakeMethodPlugin("lookup"), PluginSource("one", "sonar-lookup", "1.2.0"))
    second = (FakeMethodPlugin("lookup"), PluginSource("two", "better-lookup", "0.9"))
    with pytest.raises(DuplicateMethodError) as info:
        manager(first, second)
    assert "sonar-lookup 1.2.0" in str(info.value) and "better-lookup 0.9" in str(info.value)


def test_duplicate_alias_from_two_distributions_names_both():
    first = (FakeMethodPlugin("mtp", aliases=("deepseek_mtp",)), PluginSource("mtp", "sonar-mtp", "0.1.0"))
    second = (FakeMethodPlugin("deepseek_mtp"), PluginSource("ds", "deepseek-extras", "3.0"))
    with pytest.raises(DuplicateMethodError, match="sonar-mtp 0.1.0 and by deepseek-extras 3.0"):
        manager(first, second)


def test_two_plugins_with_one_entry_point_name():
    with pytest.raises(PluginError, match="two plugins use the entry-point name 'same'"):
        manager(
            (FakeMethodPlugin("a"), PluginSource("same", "dist-a", "1")),
            (FakeMethodPlugin("b"), PluginSource("same", "dist-b", "1")),
        )


class Misspelt:
    @hookimpl
    def sonar_register_method(self, registry):
        """A typo of sonar_register_methods."""


def test_misspelt_hook_is_an_error_with_a_suggestion():
    with pytest.raises(PluginError) as info:
        manager((Misspelt(), PluginSource("typo", "typo-plugin", "0.1")))
    message = str(info.value)
    assert "typo-plugin 0.1" in message
    assert "'sonar_register_method'" in message and "did you mean 'sonar_register_methods'?" in message


class WrongArguments:
    @hookimpl
    def sonar_register_methods(self, registry, extra):
        """Asks for an argument the hook does not provide."""


def test_hook_with_wrong_arguments_is_an_error():
    with pytest.raises(PluginError, match="does not match Sonar's hook specifications"):
        manager((WrongArguments(), PluginSource("wrong", "wrong-plugin", "0.1")))


class Failing:
    @hookimpl
    def sonar_register_methods(self, registry):
        raise RuntimeError("boom")


def test_plugin_failing_to_register_names_its_distribution():
    with pytest.raises(PluginError, match="plugin 'bad' of bad-plugin 0.1 failed while registering its methods: RuntimeError: boom"):
        manager((Failing(), PluginSource("bad", "bad-plugin", "0.1")))


def test_each_method_records_its_own_distribution():
    pm = manager(
        (FakeMethodPlugin("a"), PluginSource("a", "dist-a", "1.0")),
        (FakeMethodPlugin("b"), PluginSource("b", "dist-b", "2.0")),
    )
    assert [(s.name, s.distribution, s.version) for s in pm.method_registry.methods()] == [
        ("a", "dist-a", "1.0"), ("b", "dist-b", "2.0"),
    ]
    assert build_method_registry(pm).names() == ["a", "b"]


def test_trace_mode_logs_hook_calls(caplog):
    with caplog.at_level(logging.INFO, logger="sonar.plugins"):
        get_plugin_manager(
            load_entry_points=False,
            plugins=[(FakeMethodPlugin("a"), fake_source("a"))],
            environ={"SONAR_TRACE_HOOKS": "1"},
        )
    messages = [record.getMessage() for record in caplog.records if record.name == "sonar.plugins"]
    assert any(message.startswith("hook sonar_register_methods(registry=") for message in messages)
    assert any(message == "hook sonar_register_methods returned []" for message in messages)


def test_tracing_can_be_turned_off(caplog):
    pm = manager((FakeMethodPlugin("a"), fake_source("a")))
    undo = enable_hook_tracing(pm)
    with caplog.at_level(logging.INFO, logger="sonar.plugins"):
        pm.hook.sonar_resolve_method_alias(method="x", target=None)
        undo()
        pm.hook.sonar_resolve_method_alias(method="y", target=None)
    traced = [record.getMessage() for record in caplog.records if record.name == "sonar.plugins"]
    assert any("method='x'" in message for message in traced)
    assert not any("method='y'" in message for message in traced)


def test_without_trace_mode_nothing_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="sonar.plugins"):
        manager((FakeMethodPlugin("a"), fake_source("a")))
    assert not [record for record in caplog.records if record.name == "sonar.plugins"]


def resolved(pm, method="a"):
    return validate_speculative_config({"method": method, "num_speculative_tokens": 2}, None, pm)


def test_core_builds_the_proposer_from_the_method_spec():
    seen = {}

    def create(context, weights):
        seen["args"] = (context, weights)
        return StubProposer("spec")

    pm = manager((FakeMethodPlugin("a", create=create), fake_source("a")))
    proposer = pm.create_proposer(resolved(pm), "context")
    assert proposer.origin == "spec"
    assert seen["args"] == ("context", None)


class WeightsAndOverride:
    @hookimpl
    def sonar_load_proposer_weights(self, config, context):
        return {"w": 1} if config.method == "a" else None

    @hookimpl
    def sonar_create_proposer(self, config, context, weights):
        return StubProposer(f"override {weights}") if config.method == "a" else None


def test_a_plugins_create_proposer_comes_before_cores():
    pm = manager((FakeMethodPlugin("a"), fake_source("a")), (WeightsAndOverride(), fake_source("o")))
    assert pm.create_proposer(resolved(pm), "context").origin == "override {'w': 1}"


def test_weights_reach_the_method_factory():
    class Weights:
        @hookimpl
        def sonar_load_proposer_weights(self, config, context):
            return {"layer": 7}

    pm = manager((FakeMethodPlugin("a", create=lambda context, weights: StubProposer(str(weights))), fake_source("a")),
                 (Weights(), fake_source("w")))
    assert pm.create_proposer(resolved(pm), None).origin == "{'layer': 7}"


def test_a_factory_that_returns_no_proposer_is_an_error():
    pm = manager((FakeMethodPlugin("a", create=lambda context, weights: object()), fake_source("a")))
    with pytest.raises(PluginError, match="built object instead of a sonar_core.spec_decode.proposer.Proposer"):
        pm.create_proposer(resolved(pm), None)


def test_importing_has_no_side_effects():
    code = (
        "import sys, sonar_core.plugins, sonar_core.config, sonar_core.entrypoints.cli;"
        "loaded = [m for m in sys.modules if m.startswith(('sonar_test_plugin', 'sonar_ngram', 'sonar_core.builtin'))];"
        "print(loaded)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
