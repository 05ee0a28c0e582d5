"""Hook implementations of ``sonar-mlp-speculator``: the ``mlp_speculator`` method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.errors import ConfigError
from sonar_core.plugins import DraftArchitecture, MethodSpec, checkpoint_required, hookimpl

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext
    from sonar_mlp_speculator.speculator import MLPSpeculatorLayout

METHOD = "mlp_speculator"
LAYOUT = "IBM fms-extras MLP speculator"


class MLPSpeculatorOptions(BaseModel):
    """The MLP speculator takes only core fields; any other key is rejected."""

    model_config = ConfigDict(extra="forbid")


def _checked(model: str, hidden_size: int, vocab_size: int) -> tuple[DraftCheckpoint, MLPSpeculatorLayout]:
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_mlp_speculator.speculator import MLPSpeculatorLayout, read_layout

    checkpoint = DraftCheckpoint.open(model)
    layout = read_layout(checkpoint, hidden_size, vocab_size)
    copies = layout.tied_copies()
    checkpoint.check_layout(
        {**layout.expected(), **copies}, rename=MLPSpeculatorLayout.rename, optional=frozenset(copies)
    )
    return checkpoint, layout


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
    from sonar_mlp_speculator.speculator import MLPSpeculatorProposer, load_speculator

    config = context.speculative_config
    target = context.target_modules
    checkpoint, layout = _checked(config.model, target.hidden_size, target.vocab_size)
    speculator = load_speculator(checkpoint, layout, context.dtype, context.device)
    sampler = DraftSampler.for_context(DraftVocabularyMap.identity(layout.vocab_size, context.device), context)
    return MLPSpeculatorProposer(speculator, sampler, max_depth=None if layout.tie_weights else layout.n_predict)


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            create_proposer=create_proposer,
            description="IBM MLP speculator on the target's final hidden state",
            options_model=MLPSpeculatorOptions,
            draft_architectures=(
                DraftArchitecture(
                    "MLPSpeculatorPreTrainedModel", LAYOUT,
                    "model_type mlp_speculator; n_predict, inner_dim, tie_weights, scale_input",
                ),
            ),
        )
    )


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """The speculator's ``n_predict``, as vLLM takes it."""
    if config.method != METHOD or config.model is None or target is None:
        return None
    return _checked(config.model, target.hidden_size or 0, target.vocab_size or 0)[1].n_predict


@hookimpl
def sonar_validate_speculative_config(config: SpeculativeConfig, target: TargetInfo | None) -> list[str] | None:
    """The speculator must exist, fit the target, and have the stages for num_speculative_tokens:
    at most n_predict, or (tied weights) a multiple of it, as vLLM requires."""
    if config.method != METHOD:
        return None
    missing = checkpoint_required(config, "a trained MLP speculator")
    if missing is not None:
        raise missing
    if target is None:
        return None
    checkpoint, layout = _checked(config.model, target.hidden_size or 0, target.vocab_size or 0)
    depth, stages = config.num_speculative_tokens, layout.n_predict
    if depth > stages and not layout.tie_weights:
        raise ConfigError(
            "num_speculative_tokens",
            f"{checkpoint.describe()} has n_predict={stages} stages with their own weights, and "
            f"num_speculative_tokens={depth} asks for more",
            f"set num_speculative_tokens to at most {stages}",
        )
    if depth > stages and depth % stages:
        raise ConfigError(
            "num_speculative_tokens",
            f"num_speculative_tokens={depth} exceeds n_predict={stages} of {checkpoint.describe()} and is not a "
            "multiple of it (its tied stages repeat in rounds of n_predict)",
            f"set num_speculative_tokens to {stages} or a multiple of it",
        )
    return None
