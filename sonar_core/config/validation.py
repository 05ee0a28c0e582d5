"""Check a configuration against the target and the installed methods, before any weight loads.

Order: the method is resolved (registered names and aliases, then the plugins' alias rules, or
detected from the draft checkpoint when unset), the method's own options are validated by its
options model, core's generic rules run, then the method's own rules. The installed methods reach
these rules as a :class:`~sonar_core.config.catalogue.MethodCatalogue` (the plugin manager is
one), so configuration never imports the plugin system. Errors are :class:`ConfigError`; warnings
are logged to ``sonar.config`` and returned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from sonar_core.attention_backends import BACKENDS, get_backend
from sonar_core.config.catalogue import DraftArchitectureEntry, MethodCatalogue, MethodDescription
from sonar_core.config.engine import EngineConfig
from sonar_core.config.method_detection import detect_method
from sonar_core.config.parallel import check_tensor_parallel
from sonar_core.config.speculative import CORE_FIELDS, FIELD, METHOD_SPECIFIC_FIELDS, SpeculativeConfig
from sonar_core.config.target import TargetInfo, target_info_for
from sonar_core.config.validation_errors import config_error_from_validation, unknown_field_fix
from sonar_core.errors import ConfigError
from sonar_core.hub import CONFIG, TOKENIZER, HubError
from sonar_core.model_files import resolve_model_path

logger = logging.getLogger("sonar.config")

# Keys that users bring from elsewhere and what they meant.
_MISPLACED_KEYS: Mapping[str, str] = {
    "tensor_parallel_size": "draft_tensor_parallel_size (the target's size is --tensor-parallel-size)",
    "speculative_model": "model",
    "num_lookahead_slots": "num_speculative_tokens",
}


@dataclass(frozen=True)
class ResolvedSpeculativeConfig:
    """A speculative configuration that passed every rule, ready to build a proposer from."""

    # method is the canonical name; num_speculative_tokens and draft_tensor_parallel_size are set.
    config: SpeculativeConfig
    spec: MethodDescription
    # The method's options, validated by its options model (None when it has none).
    options: BaseModel | None
    # The name the user wrote (an alias, or the method itself).
    requested_method: str
    # Maximum draft tokens per step (config.num_speculative_tokens, known to be set).
    num_speculative_tokens: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def method(self) -> str:
        return self.spec.name

    @property
    def draft_max_model_len(self) -> int | None:
        """Longest sequence the draft handles; speculation stops beyond it (None: no extra limit)."""
        return self.config.max_model_len


@dataclass(frozen=True)
class ValidatedConfig:
    """An engine configuration with its defaults resolved against the target."""

    # max_model_len is set (the user's value or the model's limit).
    engine: EngineConfig
    target: TargetInfo
    speculative: ResolvedSpeculativeConfig | None

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.speculative.warnings if self.speculative is not None else ()


def validate_speculative_config(
    config: SpeculativeConfig | Mapping[str, Any] | str,
    target: TargetInfo | None,
    methods: MethodCatalogue,
    *,
    draft: TargetInfo | None = None,
    engine_max_model_len: int | None = None,
    log_warnings: bool = True,
) -> ResolvedSpeculativeConfig:
    """Apply every rule to ``config``; raise :class:`ConfigError` or return the resolved config.

    ``target`` enables the rules that compare with the target (its tensor-parallel size and length
    limit); ``draft`` is the draft checkpoint's info, read from ``config.model`` when a rule needs
    it and it is not given. ``methods`` is the catalogue of installed methods (the plugin manager).
    """
    config = SpeculativeConfig.build(config)
    named_model = config.model
    config = _with_local_draft(config)
    warnings: list[str] = []
    requested, spec = _resolve_method(config, named_model, target, methods, warnings)
    config = config.model_copy(update={"method": spec.name})
    options = _validate_options(config, spec)
    warnings.extend(_fields_without_effect(config, spec, methods))
    formats = [entry for entry in spec.draft_architectures if entry.serves(target.architectures if target else None)]
    if config.model is not None and formats:
        draft = draft or _draft_info(config)
        _check_draft_architecture(spec.name, formats, draft, methods)
    if config.num_speculative_tokens is None:
        default = methods.default_num_speculative_tokens(config, target)
        if default is not None:
            config = config.model_copy(update={"num_speculative_tokens": default})
    config, depth = _apply_core_rules(config, target, draft, engine_max_model_len, warnings)
    if config.max_model_len is None and config.model is not None and spec.checkpoint_limits_context:
        config = _draft_length_from_checkpoint(config, draft, engine_max_model_len)
    warnings.extend(_method_rules(config, target, methods, options))
    if log_warnings:
        for warning in warnings:
            logger.warning("%s", warning)
    return ResolvedSpeculativeConfig(config, spec, options, requested, depth, tuple(warnings))


def validate_engine_config(config: EngineConfig, target: TargetInfo) -> EngineConfig:
    """The rules of the engine fields that need the target; returns the config with max_model_len set."""
    check_tensor_parallel(target.hf_config, config.tensor_parallel_size, target.source)
    limit = target.max_position_embeddings
    if config.max_model_len is not None and limit is not None and config.max_model_len > limit:
        raise ConfigError(
            "max_model_len",
            f"{config.max_model_len} tokens exceeds the model's limit of {limit} "
            f"(max_position_embeddings in {target.source or 'its config'})",
            f"set --max-model-len {limit} or less (max_model_len in Python), or leave it unset to use the limit",
        )
    if config.max_model_len is None and limit is None:
        raise ConfigError(
            "max_model_len",
            f"the model's config ({target.source or 'unknown source'}) states no maximum sequence length",
            "set --max-model-len (max_model_len in Python) to the length the model was trained for",
        )
    return config.model_copy(update={"max_model_len": config.max_model_len or limit})


def validate_config(
    config: EngineConfig | Mapping[str, Any],
    methods: MethodCatalogue,
    *,
    target: TargetInfo | None = None,
    log_warnings: bool = True,
) -> ValidatedConfig:
    """Every rule of an engine configuration, its speculative configuration included.

    Reads the target's config (not its weights) unless ``target`` is given.
    """
    engine = config if isinstance(config, EngineConfig) else EngineConfig.build(**config)
    if target is None:
        target = target_info_for(engine.model, revision=engine.revision)
    target = target.with_parallelism(engine.tensor_parallel_size, engine.pipeline_parallel_size)
    engine = validate_engine_config(engine, target)
    _check_tokenizer(engine)
    if engine.speculative_config is None:
        return ValidatedConfig(engine, target, None)
    speculative = validate_speculative_config(
        engine.speculative_config,
        target,
        methods,
        engine_max_model_len=engine.max_model_len,
        log_warnings=log_warnings,
    )
    return ValidatedConfig(engine, target, speculative)


def _check_tokenizer(engine: EngineConfig) -> None:
    """A ``tokenizer`` that names a repository resolves (its tokenizer files are small enough to
    fetch during the check); a missing folder or repository fails here, before any weight loads."""
    if engine.tokenizer is None:
        return
    try:
        resolve_model_path(engine.tokenizer, engine.tokenizer_revision, TOKENIZER)
    except HubError as exc:
        raise ConfigError("tokenizer_revision" if exc.about_revision else "tokenizer", exc.problem, exc.fix) from None


def _draft_info(config: SpeculativeConfig) -> TargetInfo:
    """The draft checkpoint's info, errors on the draft's own fields."""
    return target_info_for(
        config.model, revision=config.revision, field=f"{FIELD}.model", revision_field=f"{FIELD}.revision"
    )


def _with_local_draft(config: SpeculativeConfig) -> SpeculativeConfig:
    """``config`` with a repository id in ``model`` replaced by its snapshot folder at ``revision``
    (config files only: the plugin that loads the draft fetches the weights into the same
    commit's folder), so that every later rule and the plugin read one commit.

    A repository that cannot be resolved stays an id: a method that loads no checkpoint then says
    to remove ``model``, and one that reads it meets the same failure as an error on ``model``.
    An unknown revision is an error at once."""
    if config.model is None or Path(config.model).expanduser().exists():
        return config
    try:
        folder = resolve_model_path(config.model, config.revision, CONFIG)
    except HubError as exc:
        if exc.about_revision:
            raise ConfigError(f"{FIELD}.revision", exc.problem, exc.fix) from None
        return config
    return config.model_copy(update={"model": str(folder)})


def _resolve_method(
    config: SpeculativeConfig,
    named_model: str | None,
    target: TargetInfo | None,
    methods: MethodCatalogue,
    warnings: list[str],
) -> tuple[str, MethodDescription]:
    requested = config.method
    if requested is None:
        if config.model is None:
            raise ConfigError(
                f"{FIELD}.method",
                "no method is set and no draft model is given",
                f'set "method" to one of the installed methods ({", ".join(methods.method_names()) or "none"}), '
                'for example {"method": "ngram", "num_speculative_tokens": 4}',
            )
        draft = _draft_info(config)
        requested, reason = detect_method(named_model or config.model, draft)
        warnings.append(
            f'{FIELD}.method is not set; using "{requested}" for model {named_model!r} ({reason}). '
            'Set "method" explicitly to silence this warning.'
        )
    spec = methods.resolve_method(requested, target)
    if spec.name != requested and config.method is not None and methods.is_old_name(requested):
        warnings.append(
            f'{FIELD}.method: {requested!r} is an old name of {spec.name!r}; write "method": '
            f'"{spec.name}" in new configurations.'
        )
    return requested, spec


def _fields_without_effect(config: SpeculativeConfig, spec: MethodDescription, methods: MethodCatalogue) -> list[str]:
    """One warning per method-specific core field the user set that ``spec`` does not read."""
    warnings = []
    for name in METHOD_SPECIFIC_FIELDS:
        unset = name not in config.model_fields_set or getattr(config, name) == SpeculativeConfig.model_fields[name].default
        if unset or name in spec.core_fields:
            continue
        readers = methods.methods_reading(name)
        where = f"it applies to {', '.join(readers)}" if readers else "no installed method reads it"
        warnings.append(
            f"{FIELD}.{name} has no effect with method {spec.name!r} ({where}); remove it from the configuration."
        )
    return warnings


def _validate_options(config: SpeculativeConfig, spec: MethodDescription) -> BaseModel | None:
    extras = config.method_options
    option_names = tuple(spec.options_model.model_fields) if spec.options_model is not None else ()
    # The keys suggested for a typo: the fields every method reads, those this one declares, its options.
    core = [name for name in CORE_FIELDS if name not in METHOD_SPECIFIC_FIELDS or name in spec.core_fields]
    accepted = (*core, *option_names)
    unknown = [key for key in extras if key not in option_names]
    if unknown:
        first, *rest = (_unknown_option(key, spec.name, accepted) for key in unknown)
        raise ConfigError(first.field, first.message, first.fix, also=rest)
    if spec.options_model is None:
        return None
    try:
        return spec.options_model.model_validate(extras)
    except ValidationError as exc:
        raise config_error_from_validation(exc, FIELD, accepted) from None


def _unknown_option(key: str, method: str, accepted: tuple[str, ...]) -> ConfigError:
    if key in _MISPLACED_KEYS:
        fix = f"use {_MISPLACED_KEYS[key]} instead of {key!r}"
    else:
        fix = unknown_field_fix(key, accepted, f"method {method!r}")
    return ConfigError(f"{FIELD}.{key}", f"{key!r} is not an option of method {method!r}", fix)


def _apply_core_rules(
    config: SpeculativeConfig,
    target: TargetInfo | None,
    draft: TargetInfo | None,
    engine_max_model_len: int | None,
    warnings: list[str],
) -> tuple[SpeculativeConfig, int]:
    """Core's generic rules; returns the config with its defaults filled, and its depth."""
    method = config.method
    if config.num_speculative_tokens is None:
        raise ConfigError(
            f"{FIELD}.num_speculative_tokens",
            f"method {method!r} needs the maximum number of draft tokens per step, and none is set",
            'add "num_speculative_tokens"; start with 1 to 3 and raise it while later positions are still accepted',
        )
    target_tp = target.tensor_parallel_size if target is not None else 1
    draft_tp = config.draft_tensor_parallel_size or 1
    if draft_tp not in (1, target_tp):
        raise ConfigError(
            f"{FIELD}.draft_tensor_parallel_size",
            f"draft_tensor_parallel_size={draft_tp} is neither 1 nor the target's tensor_parallel_size ({target_tp})",
            f"set draft_tensor_parallel_size to 1 or {target_tp}, or remove it (1 is the default)",
        )
    if (config.num_draft_branches or 1) > 1 and target_tp > 1:
        raise ConfigError(
            f"{FIELD}.num_draft_branches",
            f"draft branches fork each request's KV on one rank, and the target is split over {target_tp}",
            "remove num_draft_branches (one chain per request), or run the target on one rank",
        )
    _check_attention_backend(config)
    if config.max_model_len is not None:
        _check_draft_length(config.max_model_len, config.model, target, draft)
        if engine_max_model_len is not None and config.max_model_len > engine_max_model_len:
            warnings.append(
                f"{FIELD}.max_model_len={config.max_model_len} is larger than the engine's max_model_len="
                f"{engine_max_model_len}; requests never get that long, so it has no effect."
            )
    return config.model_copy(update={"draft_tensor_parallel_size": draft_tp}), config.num_speculative_tokens


def _draft_length_from_checkpoint(
    config: SpeculativeConfig, draft: TargetInfo | None, engine_max_model_len: int | None
) -> SpeculativeConfig:
    """Unset, the draft's max_model_len is the draft checkpoint's own limit where that is shorter
    than the engine's: longer requests then stop speculating instead of drafting past it."""
    draft = draft or _draft_info(config)
    limit = draft.max_position_embeddings
    if limit is None or (engine_max_model_len is not None and limit >= engine_max_model_len):
        return config
    return config.model_copy(update={"max_model_len": limit})


def _check_attention_backend(config: SpeculativeConfig) -> None:
    if config.attention_backend is not None and get_backend(config.attention_backend) is None:
        names = ", ".join(f"{name} ({backend.description})" for name, backend in BACKENDS.items())
        raise ConfigError(
            f"{FIELD}.attention_backend",
            f"{config.attention_backend!r} is not an attention backend of Sonar",
            f"use one of {names}, or remove attention_backend for the default",
        )


def _check_draft_length(
    length: int, draft_model: str | None, target: TargetInfo | None, draft: TargetInfo | None
) -> None:
    """The draft max_model_len cannot exceed the target's limit, nor the draft checkpoint's."""
    if draft is None and draft_model is not None:
        draft = target_info_for(draft_model, field=f"{FIELD}.model")
    checkpoints = [("target", target)] + ([("draft", draft)] if draft_model is not None else [])
    for role, info in checkpoints:
        limit = info.max_position_embeddings if info is not None else None
        if limit is not None and length > limit:
            raise ConfigError(
                f"{FIELD}.max_model_len",
                f"the draft max_model_len={length} exceeds the {role} checkpoint's limit of {limit} "
                f"tokens ({info.source or 'its config'}); it cannot exceed either checkpoint's limit",
                f"set max_model_len to {limit} or less, or remove it",
            )


def _check_draft_architecture(
    method: str, formats: list[DraftArchitectureEntry], draft: TargetInfo, methods: MethodCatalogue
) -> None:
    """The draft checkpoint must be one of the architectures the method registered for the target."""
    supported = [entry.architecture for entry in formats]
    if any(name in supported for name in draft.architectures):
        return
    if not draft.architectures and any(
        entry.config_key is not None and entry.config_key in draft.hf_config for entry in formats
    ):
        return
    found = ", ".join(draft.architectures) or "none"
    others = [name for arch in draft.architectures for name in methods.methods_for_draft_architecture(arch)]
    hint = f'it is a draft for method {others[0]!r}: use "method": "{others[0]}", or ' if others else ""
    raise ConfigError(
        f"{FIELD}.model",
        f"the draft checkpoint {draft.source or 'config'} declares architectures [{found}] "
        f"(model_type {draft.model_type or 'unset'!r}), which method {method!r} does not support; "
        f"its registered draft architectures are: {', '.join(dict.fromkeys(supported))}",
        f"{hint}check the checkpoint's architectures and model_type fields against the supported-model table "
        "(`aphrodite plugins --models`, docs/supported-models.md); pick a draft trained for this method, "
        "or update Sonar when the checkpoint needs a newer implementation",
    )


def _method_rules(
    config: SpeculativeConfig, target: TargetInfo | None, methods: MethodCatalogue, options: BaseModel | None
) -> list[str]:
    try:
        return methods.method_rules(config, target, options)
    except ConfigError as exc:
        raise exc.with_field_prefix(FIELD) from None
