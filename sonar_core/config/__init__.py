"""Sonar's configuration: one set of models for the command line, the Python API and JSON.

- :class:`EngineConfig`: the engine flags (``--max-model-len`` is ``max_model_len``) and the
  speculative configuration.
- :class:`SpeculativeConfig`: ``--speculative-config '{...}'`` / ``speculative_config={...}``.
- :class:`TargetInfo` / :func:`target_info_for`: a checkpoint's limits, read from its config only.
- :func:`validate_config` / :func:`validate_speculative_config`: every rule, before weights load.

Every rule raises :class:`sonar_core.errors.ConfigError` naming the field and the fix; the rules
and the tests that cover them are listed in docs/configuration.md.
"""

from sonar_core.config.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DTYPE_ALIASES, EngineConfig
from sonar_core.config.json_value import SHELL_QUOTING_ADVICE, parse_json_object
from sonar_core.config.speculative import CORE_FIELDS, METHOD_SPECIFIC_FIELDS, SpeculativeConfig
from sonar_core.config.target import TargetInfo, target_info_for
from sonar_core.config.validation import (
    ResolvedSpeculativeConfig,
    ValidatedConfig,
    validate_config,
    validate_engine_config,
    validate_speculative_config,
)
from sonar_core.config.validation_errors import config_error_from_validation

__all__ = [
    "CORE_FIELDS",
    "METHOD_SPECIFIC_FIELDS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DTYPE_ALIASES",
    "SHELL_QUOTING_ADVICE",
    "EngineConfig",
    "ResolvedSpeculativeConfig",
    "SpeculativeConfig",
    "TargetInfo",
    "ValidatedConfig",
    "config_error_from_validation",
    "parse_json_object",
    "target_info_for",
    "validate_config",
    "validate_engine_config",
    "validate_speculative_config",
]
