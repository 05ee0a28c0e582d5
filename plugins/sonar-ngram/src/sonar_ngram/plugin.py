"""Hook implementations of the ``sonar-ngram`` distribution (entry point ``ngram`` in group ``sonar``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from sonar_core.errors import ConfigError
from sonar_core.plugins import MethodSpec, checkpoint_refused, hookimpl, one_hot_drafts_warning
from sonar_core.spec_decode.prompt_lookup import lookup_bound_errors

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHODS = ("ngram", "ngram_gpu")
LOOKUP_FIELDS = frozenset({"prompt_lookup_min", "prompt_lookup_max"})
# A ``model`` that only repeats the method name is the legacy vLLM spelling of the method
# (``"[ngram]"``); anything else names a checkpoint the method would ignore.
_METHOD_NAMES_AS_MODEL = frozenset({"ngram", "[ngram]", "ngram_gpu"})


class NgramOptions(BaseModel):
    """The n-gram methods take only core fields (``prompt_lookup_min``/``max``,
    ``num_speculative_tokens``); any other key is a mistake and is rejected."""

    model_config = ConfigDict(extra="forbid")


def create_ngram_proposer(context: ProposerContext, weights: dict | None) -> Proposer:
    # The proposers (torch, numpy) are imported when a method is used, not when it registers.
    from sonar_ngram.proposer import create_ngram_proposer as create

    return create(context, weights)


def create_ngram_gpu_proposer(context: ProposerContext, weights: dict | None) -> Proposer:
    from sonar_ngram.proposer import create_ngram_gpu_proposer as create

    return create(context, weights)


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    """Register ``ngram`` (with vLLM's old spelling ``[ngram]``, from ``"model": "[ngram]"``
    configurations, as an old name) and ``ngram_gpu``."""
    registry.register(
        MethodSpec(
            name="ngram",
            core_fields=LOOKUP_FIELDS,
            create_proposer=create_ngram_proposer,
            description='CPU prompt lookup (old name [ngram]: vLLM\'s "model": "[ngram]" spelling)',
            options_model=NgramOptions,
        ),
        old_names=("[ngram]",),
    )
    registry.register(
        MethodSpec(
            name="ngram_gpu",
            core_fields=LOOKUP_FIELDS,
            create_proposer=create_ngram_gpu_proposer,
            description="GPU prompt lookup",
            options_model=NgramOptions,
        )
    )


@hookimpl
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None
) -> list[str] | None:
    """The n-gram rules: window bounds of at least 1 with min <= max (after vLLM's defaults), no
    checkpoint, and a warning for probabilistic drafting. Other methods are not checked here."""
    if config.method not in METHODS:
        return None
    errors = lookup_bound_errors(config.prompt_lookup_min, config.prompt_lookup_max, config.method)
    if config.model not in _METHOD_NAMES_AS_MODEL:
        refused = checkpoint_refused(config, "the request's own tokens")
        if refused is not None:
            errors.append(refused)
    if errors:
        # One error carrying the others, so every problem is reported in the same run.
        first, *rest = errors
        raise ConfigError(first.field, first.message, first.fix, also=rest)
    warning = one_hot_drafts_warning(config)
    return [warning] if warning else []
