"""Every rule of the speculative configuration, through the Python API."""

from __future__ import annotations

import logging

import pytest
from plugin_fakes import FakeMethodPlugin
from pydantic import BaseModel, ConfigDict

from sonar_core.config import SpeculativeConfig, TargetInfo, validate_speculative_config
from sonar_core.errors import ConfigError
from sonar_core.plugins import MTP_LEGACY_METHOD_NAMES, SONAR_METHOD_PACKAGES, hookimpl, install_command

DOCUMENTED_METHODS = (
    "mtp", "dspark", "dflash", "eagle", "eagle3", "draft_model", "mlp_speculator", "medusa", "ngram",
    "ngram_gpu", "suffix", "custom_class", "extract_hidden_states",
)


def target(limit: int = 512, tp: int = 1, model_type: str = "llama") -> TargetInfo:
    return TargetInfo(("LlamaForCausalLM",), model_type, 256, limit, tensor_parallel_size=tp, source="target/config.json")


@pytest.fixture
def lookup(manager_with):
    """A manager with one option-less method ``lookup``."""
    return manager_with(FakeMethodPlugin("lookup"))


def validate(config, manager, **kwargs):
    return validate_speculative_config(config, kwargs.pop("target", None), manager, **kwargs)


# --- the method -------------------------------------------------------------------------------


def test_every_documented_method_has_a_package():
    assert set(DOCUMENTED_METHODS) <= set(SONAR_METHOD_PACKAGES)
    assert len(DOCUMENTED_METHODS) == 13


@pytest.mark.parametrize("method", DOCUMENTED_METHODS + MTP_LEGACY_METHOD_NAMES)
def test_unknown_sonar_method_names_its_package(method, lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": method, "num_speculative_tokens": 2}, lookup)
    error = info.value
    assert error.field == "speculative_config.method"
    assert install_command(SONAR_METHOD_PACKAGES[method]) in error.fix
    assert "pip install -e " in error.fix
    assert "Installed methods: lookup" in error.message


def test_unknown_method_lists_installed_methods_and_suggests_the_closest(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup"), FakeMethodPlugin("table"))
    with pytest.raises(ConfigError) as info:
        validate({"method": "lokup", "num_speculative_tokens": 2}, manager)
    assert "Installed methods: lookup, table" in str(info.value)
    assert "did you mean 'lookup'?" in info.value.fix


def test_unknown_method_typo_of_a_sonar_method_suggests_its_package(lookup):
    with pytest.raises(ConfigError, match=r"did you mean 'dflash' \(from sonar-dflash: pip install -e plugins/sonar-dflash"):
        validate({"method": "dflsh", "num_speculative_tokens": 2}, lookup)


def test_method_unset_without_model_is_an_error(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"num_speculative_tokens": 2}, lookup)
    assert info.value.field == "speculative_config.method"
    assert "lookup" in info.value.fix


def test_method_unset_with_model_means_draft_model(manager_with, make_model_dir):
    manager = manager_with(FakeMethodPlugin("draft_model"))
    resolved = validate({"model": str(make_model_dir("draft")), "num_speculative_tokens": 2}, manager)
    assert resolved.method == "draft_model"
    assert any("method is not set" in warning for warning in resolved.warnings)


@pytest.mark.parametrize(
    ("config", "method", "reason"),
    [
        ({"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]}, "eagle3", "speculators_model_type"),
        ({"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}, "dflash", "architecture"),
        ({"architectures": ["MedusaModel"], "model_type": "medusa"}, "medusa", "model_type"),
        ({"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator"}, "mlp_speculator", "model_type"),
    ],
)
def test_method_unset_is_detected_from_the_draft_config(config, method, reason, manager_with, make_model_dir):
    manager = manager_with(FakeMethodPlugin(method))
    folder = make_model_dir("head", **config)
    resolved = validate({"model": str(folder), "num_speculative_tokens": 2}, manager)
    assert resolved.method == method
    assert any(f'using "{method}"' in w and reason in w for w in resolved.warnings)


def test_method_unset_is_detected_from_the_draft_name(manager_with, make_model_dir):
    manager = manager_with(FakeMethodPlugin("eagle3"))
    folder = make_model_dir("my-EAGLE3-head")
    resolved = validate({"model": str(folder), "num_speculative_tokens": 2}, manager)
    assert resolved.method == "eagle3"
    assert any("name contains 'eagle3'" in w for w in resolved.warnings)


def test_a_plain_alias_resolves_silently(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup", aliases=("pl",)))
    resolved = validate({"method": "pl", "num_speculative_tokens": 1}, manager)
    assert resolved.method == "lookup" and resolved.requested_method == "pl"
    assert not resolved.warnings


def test_registered_old_name_resolves_with_a_warning(manager_with, caplog):
    manager = manager_with(FakeMethodPlugin("mtp", old_names=("deepseek_mtp", "mimo_mtp")))
    with caplog.at_level(logging.WARNING, logger="sonar.config"):
        resolved = validate({"method": "deepseek_mtp", "num_speculative_tokens": 1}, manager)
    assert resolved.method == "mtp"
    assert resolved.config.method == "mtp"
    assert resolved.requested_method == "deepseek_mtp"
    assert 'write "method": "mtp"' in resolved.warnings[0]
    assert any("deepseek_mtp" in record.getMessage() for record in caplog.records)


class FamilyAliases:
    """Maps ``family_x`` to ``lookup`` for targets of model_type ``fam``, and ``ghost`` to nothing known."""

    name = "family"

    @hookimpl
    def sonar_resolve_method_alias(self, method, target):
        if method == "family_x" and target is not None and target.model_type == "fam":
            return "lookup"
        return "not_registered" if method == "ghost" else None


def test_alias_hook_resolves_depending_on_the_target(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup"), FamilyAliases())
    resolved = validate({"method": "family_x", "num_speculative_tokens": 2}, manager, target=target(model_type="fam"))
    assert resolved.method == "lookup"
    with pytest.raises(ConfigError, match="'family_x' is not a speculation method"):
        validate({"method": "family_x", "num_speculative_tokens": 2}, manager, target=target(model_type="other"))


def test_alias_hook_to_an_unregistered_method_is_an_error(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup"), FamilyAliases())
    with pytest.raises(ConfigError, match="maps 'ghost' to 'not_registered'"):
        validate({"method": "ghost", "num_speculative_tokens": 2}, manager)


@pytest.mark.parametrize("field", ["method", "model"])
def test_blank_strings_are_rejected(field, lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, field: "  "}, lookup)
    assert info.value.field == f"speculative_config.{field}"


# --- num_speculative_tokens ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, -3])
def test_num_speculative_tokens_must_be_positive(depth, lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": depth}, lookup)
    assert info.value.field == "speculative_config.num_speculative_tokens"
    assert "1 or more" in info.value.fix


@pytest.mark.parametrize("stop", [-0.1, 1.5])
def test_draft_stop_confidence_must_be_a_probability(stop, lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "draft_stop_confidence": stop}, lookup)
    assert info.value.field == "speculative_config.draft_stop_confidence"
    assert "between 0 and 1" in info.value.message and "set draft_stop_confidence to 0" in info.value.fix


def test_draft_stop_confidence_is_warned_about_where_the_method_does_not_read_it(manager_with):
    resolved = validate({"method": "lookup", "num_speculative_tokens": 2, "draft_stop_confidence": 0.5},
                        manager_with(FakeMethodPlugin("lookup")))
    assert any("draft_stop_confidence has no effect" in warning for warning in resolved.warnings)


def test_num_speculative_tokens_is_required(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup"}, lookup)
    assert info.value.field == "speculative_config.num_speculative_tokens"


def test_a_method_may_default_num_speculative_tokens(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup", default_depth=5))
    resolved = validate({"method": "lookup"}, manager)
    assert resolved.num_speculative_tokens == 5 == resolved.config.num_speculative_tokens
    # An explicit value always wins.
    assert validate({"method": "lookup", "num_speculative_tokens": 2}, manager).num_speculative_tokens == 2


def test_num_speculative_tokens_must_be_an_integer(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": "four"}, lookup)
    assert info.value.field == "speculative_config.num_speculative_tokens"
    assert info.value.fix == "give a whole number"


# --- draft_tensor_parallel_size ------------------------------------------------------------------


@pytest.mark.parametrize(("draft_tp", "target_tp"), [(2, 1), (3, 2), (0, 1)])
def test_draft_tensor_parallel_size_is_one_or_the_targets(draft_tp, target_tp, lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "draft_tensor_parallel_size": draft_tp},
                 lookup, target=target(tp=target_tp))
    assert info.value.field == "speculative_config.draft_tensor_parallel_size"


@pytest.mark.parametrize(("draft_tp", "target_tp", "expected"), [(None, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_draft_tensor_parallel_size_accepted_values(draft_tp, target_tp, expected, lookup):
    config = {"method": "lookup", "num_speculative_tokens": 2}
    if draft_tp is not None:
        config["draft_tensor_parallel_size"] = draft_tp
    resolved = validate(config, lookup, target=target(tp=target_tp))
    assert resolved.config.draft_tensor_parallel_size == expected


# --- max_model_len of the draft ------------------------------------------------------------------


def test_draft_max_model_len_cannot_exceed_the_targets_limit(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "max_model_len": 1024}, lookup, target=target(512))
    assert info.value.field == "speculative_config.max_model_len"
    assert "target checkpoint's limit of 512" in info.value.message


def test_draft_max_model_len_cannot_exceed_the_draft_checkpoints_limit(lookup, make_model_dir):
    draft = make_model_dir("draft", max_position_embeddings=256)
    config = {"method": "lookup", "model": str(draft), "num_speculative_tokens": 2, "max_model_len": 400}
    with pytest.raises(ConfigError) as info:
        validate(config, lookup, target=target(512))
    assert "draft checkpoint's limit of 256" in info.value.message
    assert "256 or less" in info.value.fix


def test_draft_max_model_len_within_both_limits_is_kept(lookup, make_model_dir):
    draft = make_model_dir("draft", max_position_embeddings=1024)
    config = {"method": "lookup", "model": str(draft), "num_speculative_tokens": 2, "max_model_len": 300}
    resolved = validate(config, lookup, target=target(512))
    assert resolved.draft_max_model_len == 300


def test_draft_max_model_len_must_be_positive(lookup):
    with pytest.raises(ConfigError, match="must be positive"):
        validate({"method": "lookup", "num_speculative_tokens": 2, "max_model_len": 0}, lookup)


def test_draft_max_model_len_above_the_engines_warns(lookup):
    resolved = validate(
        {"method": "lookup", "num_speculative_tokens": 2, "max_model_len": 400}, lookup,
        target=target(512), engine_max_model_len=300,
    )
    assert any("has no effect" in warning for warning in resolved.warnings)


# --- sampling ----------------------------------------------------------------------------------


def test_heterogeneous_vocab_needs_greedy_drafting(lookup):
    config = {"method": "lookup", "num_speculative_tokens": 2, "use_heterogeneous_vocab": True,
              "draft_sample_method": "probabilistic"}
    with pytest.raises(ConfigError) as info:
        validate(config, lookup)
    assert info.value.field == "speculative_config.use_heterogeneous_vocab"
    assert "greedy" in info.value.fix


def test_heterogeneous_vocab_with_greedy_drafting_is_accepted(lookup):
    resolved = validate({"method": "lookup", "num_speculative_tokens": 2, "use_heterogeneous_vocab": True}, lookup)
    assert resolved.config.use_heterogeneous_vocab


def test_draft_sample_method_values(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "draft_sample_method": "random"}, lookup)
    assert info.value.field == "speculative_config.draft_sample_method"
    assert "'greedy' or 'probabilistic'" in info.value.fix
    assert SpeculativeConfig().draft_sample_method == "greedy"


# --- method options ------------------------------------------------------------------------------


class TableOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    table_size: int = 64


def test_unknown_key_is_rejected_naming_key_and_method(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "num_speculative_token": 3}, lookup)
    error = info.value
    assert error.field == "speculative_config.num_speculative_token"
    assert "not an option of method 'lookup'" in error.message
    assert "did you mean 'num_speculative_tokens'?" in error.fix


def test_every_unknown_key_is_reported_at_once(lookup):
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "alpha": 1, "beta": 2}, lookup)
    assert [info.value.field, *(other.field for other in info.value.also)] == [
        "speculative_config.alpha", "speculative_config.beta",
    ]


def test_target_tensor_parallel_size_in_the_speculative_config_points_to_the_draft_field(lookup):
    with pytest.raises(ConfigError, match="use draft_tensor_parallel_size"):
        validate({"method": "lookup", "num_speculative_tokens": 2, "tensor_parallel_size": 2}, lookup)


def test_method_options_are_validated_by_the_plugins_model(manager_with):
    manager = manager_with(FakeMethodPlugin("table", options_model=TableOptions))
    resolved = validate({"method": "table", "num_speculative_tokens": 2, "table_size": 128}, manager)
    assert resolved.options == TableOptions(table_size=128)
    assert resolved.config.method_options == {"table_size": 128}
    with pytest.raises(ConfigError) as info:
        validate({"method": "table", "num_speculative_tokens": 2, "table_sise": 128}, manager)
    assert "did you mean 'table_size'?" in info.value.fix
    with pytest.raises(ConfigError) as info:
        validate({"method": "table", "num_speculative_tokens": 2, "table_size": "big"}, manager)
    assert info.value.field == "speculative_config.table_size"


# --- plugin rules --------------------------------------------------------------------------------


def test_plugin_rule_error_names_the_speculative_field(manager_with):
    def rule(config, target):
        raise ConfigError("prompt_lookup_min", "too small", "raise it")

    manager = manager_with(FakeMethodPlugin("lookup", rule=rule))
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2}, manager)
    assert info.value.field == "speculative_config.prompt_lookup_min"
    assert str(info.value) == "speculative_config.prompt_lookup_min: too small. Fix: raise it."


def test_plugin_rules_see_the_canonical_method_and_the_target(manager_with):
    seen = []

    def rule(config, target_info):
        seen.append((config.method, target_info.model_type))
        return ["doubtful but valid"]

    manager = manager_with(FakeMethodPlugin("mtp", aliases=("mimo_mtp",), rule=rule))
    resolved = validate({"method": "mimo_mtp", "num_speculative_tokens": 1}, manager, target=target())
    assert seen == [("mtp", "llama")]
    assert "doubtful but valid" in resolved.warnings


def test_warnings_are_logged_to_sonar_config(manager_with, caplog):
    manager = manager_with(FakeMethodPlugin("lookup", rule=lambda config, target: ["check this"]))
    with caplog.at_level(logging.WARNING, logger="sonar.config"):
        validate({"method": "lookup", "num_speculative_tokens": 2}, manager)
    assert [record.getMessage() for record in caplog.records if record.name == "sonar.config"] == ["check this"]


# --- input forms ---------------------------------------------------------------------------------


def test_json_text_dict_and_model_are_one_configuration(lookup):
    as_text = validate('{"method": "lookup", "num_speculative_tokens": 3}', lookup)
    as_dict = validate({"method": "lookup", "num_speculative_tokens": 3}, lookup)
    as_model = validate(SpeculativeConfig(method="lookup", num_speculative_tokens=3), lookup)
    assert as_text.config == as_dict.config == as_model.config


def test_configuration_must_be_an_object(lookup):
    with pytest.raises(ConfigError, match="expected a JSON object or a dict, got list"):
        validate(["lookup"], lookup)


def test_every_documented_field_has_a_default_and_a_docstring():
    documented = {
        "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
        "draft_tensor_parallel_size", "use_heterogeneous_vocab", "draft_sample_method", "attention_backend",
        "max_model_len", "parallel_drafting",
    }
    fields = SpeculativeConfig.model_fields
    assert documented <= set(fields)
    for name in documented:
        assert not fields[name].is_required(), name
        assert fields[name].description, name


# --- draft architectures ------------------------------------------------------------------------


def test_a_draft_of_an_unregistered_architecture_is_refused_before_loading(manager_with, make_model_dir):
    from sonar_core.plugins import DraftArchitecture

    plugin = FakeMethodPlugin("heads", draft_architectures=(DraftArchitecture("HeadModel", "test layout"),))
    manager = manager_with(plugin)
    good = make_model_dir("good", architectures=["HeadModel"], model_type="head")
    assert validate({"method": "heads", "model": str(good), "num_speculative_tokens": 2}, manager).method == "heads"
    bad = make_model_dir("bad", architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ConfigError) as info:
        validate({"method": "heads", "model": str(bad), "num_speculative_tokens": 2}, manager)
    error = info.value
    assert error.field == "speculative_config.model"
    assert "[MistralForCausalLM]" in error.message and "'mistral'" in error.message and "HeadModel" in error.message
    assert "architectures and model_type" in error.fix and "aphrodite plugins --models" in error.fix


def test_a_field_the_method_does_not_read_is_warned_about_once_in_core(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup"))
    resolved = validate(
        {"method": "lookup", "num_speculative_tokens": 2, "attention_backend": "FLASH_ATTN", "use_heterogeneous_vocab": True},
        manager,
    )
    assert len(resolved.warnings) == 2
    assert resolved.warnings[0].startswith("speculative_config.use_heterogeneous_vocab has no effect with method 'lookup'")
    assert "attention_backend has no effect" in resolved.warnings[1] and "no installed method reads it" in resolved.warnings[1]
    # A value equal to the default changes nothing and is not warned about.
    assert not validate({"method": "lookup", "num_speculative_tokens": 2, "use_heterogeneous_vocab": False}, manager).warnings


def test_a_typo_suggests_only_fields_the_method_reads(manager_with):
    manager = manager_with(FakeMethodPlugin("lookup"))
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "prompt_lookup_mx": 3}, manager)
    assert "prompt_lookup_max" not in info.value.fix


def test_a_plugins_own_value_rule_is_reported_in_its_words(manager_with):
    """A field_validator's message is the error, said once, not Sonar's docs for a third-party option."""
    from pydantic import BaseModel, ConfigDict, field_validator

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mode: str = "a"

        @field_validator("mode")
        @classmethod
        def _known(cls, value: str) -> str:
            if value not in ("a", "b"):
                raise ValueError(f"mode must be 'a' or 'b', got {value!r}")
            return value

    manager = manager_with(FakeMethodPlugin("lookup", options_model=Options))
    with pytest.raises(ConfigError) as info:
        validate({"method": "lookup", "num_speculative_tokens": 2, "mode": "c"}, manager)
    assert info.value.field == "speculative_config.mode"
    assert info.value.message == "mode must be 'a' or 'b', got 'c'"
    assert "docs/configuration.md" not in info.value.fix and "value error" not in str(info.value).lower()


def test_the_validation_hook_receives_the_validated_options_with_defaults(manager_with):
    from pydantic import BaseModel, ConfigDict

    from sonar_core.plugins import hookimpl

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        window: int = 8

    seen = []

    class Checker:
        @hookimpl
        def sonar_validate_speculative_config(self, config, target, options):
            seen.append((dict(config.method_options), options))

    manager = manager_with(FakeMethodPlugin("lookup", options_model=Options), Checker())
    validate({"method": "lookup", "num_speculative_tokens": 2}, manager)
    raw, options = seen[0]
    assert raw == {} and isinstance(options, Options) and options.window == 8
