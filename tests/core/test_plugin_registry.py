"""MethodRegistry: names, aliases, sources and duplicates."""

from __future__ import annotations

import pickle

import pytest

from sonar_core.builtin_methods.custom_class import CustomClassNotFoundError
from sonar_core.errors import ConfigError, DuplicateMethodError
from sonar_core.plugins import MethodRegistry, MethodSpec


def spec(name: str) -> MethodSpec:
    return MethodSpec(name, lambda context, weights: None, description=f"method {name}")


@pytest.fixture
def registry() -> MethodRegistry:
    registry = MethodRegistry()
    with registry.registering_for("sonar-ngram", "0.1.0"):
        registry.register(spec("ngram"), aliases=("[ngram]",))
        registry.register(spec("ngram_gpu"))
    return registry


def test_register_stamps_the_distribution(registry):
    assert [(s.name, s.distribution, s.version) for s in registry.methods()] == [
        ("ngram", "sonar-ngram", "0.1.0"), ("ngram_gpu", "sonar-ngram", "0.1.0"),
    ]


def test_resolve_names_and_aliases(registry):
    assert registry.resolve("ngram").name == "ngram"
    assert registry.resolve("[ngram]").name == "ngram"
    assert registry.canonical_name("[ngram]") == "ngram"
    assert registry.canonical_name("eagle") is None
    assert registry.aliases_of("ngram") == ("[ngram]",)
    assert "[ngram]" in registry and "eagle" not in registry
    assert len(registry) == 2 and registry.names() == ["ngram", "ngram_gpu"]


def test_resolve_unknown_is_a_config_error(registry):
    with pytest.raises(ConfigError, match="pip install -e plugins/sonar-eagle"):
        registry.resolve("eagle3")


@pytest.mark.parametrize(
    ("name", "aliases"),
    [("ngram", ()), ("prompt_lookup", ("ngram_gpu",)), ("[ngram]", ()), ("other", ("[ngram]",))],
)
def test_duplicate_names_and_aliases_name_both_distributions(registry, name, aliases):
    with registry.registering_for("my-lookup", "2.0"), pytest.raises(DuplicateMethodError) as info:
        registry.register(spec(name), aliases=aliases)
    message = str(info.value)
    assert "sonar-ngram 0.1.0" in message and "my-lookup 2.0" in message
    # Nothing of the failed registration is kept.
    assert registry.names() == ["ngram", "ngram_gpu"]
    assert registry.aliases_of("ngram") == ("[ngram]",) and registry.aliases_of("ngram_gpu") == ()


def test_an_alias_equal_to_the_name_is_ignored():
    registry = MethodRegistry()
    registry.register(spec("mtp"), aliases=("mtp", "deepseek_mtp", "deepseek_mtp"))
    assert registry.aliases_of("mtp") == ("deepseek_mtp",)


@pytest.mark.parametrize("bad", ["", "two words", None])
def test_invalid_names_are_rejected(bad):
    with pytest.raises(ValueError, match="non-empty string without spaces"):
        MethodRegistry().register(spec("ok"), aliases=(bad,))


def test_only_method_specs_are_accepted():
    with pytest.raises(TypeError, match="takes a MethodSpec"):
        MethodRegistry().register("ngram")


def test_errors_survive_pickling():
    error = DuplicateMethodError("ngram", "a 1", "b 2")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    config_error = ConfigError("f", "m", "x", also=[ConfigError("g", "n", "y")])
    assert str(pickle.loads(pickle.dumps(config_error))) == str(config_error)
    subclass_error = CustomClassNotFoundError("no class", "fix it")
    restored = pickle.loads(pickle.dumps(subclass_error))
    assert type(restored) is CustomClassNotFoundError and str(restored) == str(subclass_error)


def test_field_prefix_keeps_the_error_class():
    error = CustomClassNotFoundError("no class", "fix it").with_field_prefix("outer")
    assert type(error) is CustomClassNotFoundError
    assert error.field == "outer.speculative_config.custom_class"
    assert ConfigError("speculative_config.x", "m", "f").with_field_prefix("speculative_config").field == "speculative_config.x"


def test_a_method_of_a_package_that_failed_to_load_carries_the_import_error(registry):
    registry.failed["sonar-suffix"] = ("plugin 'suffix' of sonar-suffix 0.1.0", "ImportError: arctic_inference is broken")
    with pytest.raises(ConfigError) as info:
        registry.resolve("suffix")
    assert "comes from sonar-suffix, which is installed but failed to load" in info.value.message
    assert "ImportError: arctic_inference is broken" in info.value.message
    assert info.value.fix == (
        "reinstall it: pip install --force-reinstall -e plugins/sonar-suffix (in a Sonar checkout; sonar-suffix installs from "
        "that folder)"
    )
