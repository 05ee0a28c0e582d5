"""Hook implementations of ``sonar-dspark``: the ``dspark`` method.

Checkpoints: DeepSpec's ``Qwen3DSparkModel`` and speculators' ``DSparkSpeculator`` given in
``model``, or DSpark weights embedded in the target checkpoint (``model`` omitted): tensors under
``dspark.`` with the draft config as the target config's ``dspark_config`` entry (its own fields
over the target's). A block drafts ``block_size`` tokens from the anchor; ``num_speculative_tokens``
below the block size is refused (the guide: it gives the draft an unsupported layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from sonar_core.errors import ConfigError
from sonar_core.plugins import (
    DraftArchitecture,
    MethodSpec,
    hookimpl,
    non_causal_backend_refused,
    parallel_drafting_refused,
)
from sonar_core.spec_decode.layout_names import DEEPSPEC_DSPARK, SPECULATORS_DSPARK

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.block_layout import BlockLayout
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.head_loading import HeadSpec
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "dspark"
EMBEDDED_PREFIX = "dspark."
EMBEDDED_CONFIG_KEY = "dspark_config"


class DSparkOptions(BaseModel):
    """The keys of ``dspark`` beyond the core fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    confidence_threshold: float = Field(0.0, ge=0.0, le=1.0)
    """Cut each proposal at the first draft whose predicted acceptance (the checkpoint's confidence
    head) is below this; 0 keeps the whole block. Needs a checkpoint with a confidence head."""


def _checkpoint(model: str | None, target_folder: Path | None) -> DraftCheckpoint:
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint

    if model is not None:
        return DraftCheckpoint.open(model)
    embedded = DraftCheckpoint.embedded(target_folder, EMBEDDED_CONFIG_KEY, EMBEDDED_PREFIX) if target_folder else None
    if embedded is None or not embedded.shapes:
        raise ConfigError(
            "model",
            "method 'dspark' has no model and the target embeds no DSpark weights "
            f"(a {EMBEDDED_CONFIG_KEY!r} entry in its config.json and tensors under {EMBEDDED_PREFIX!r})",
            'set "model" to the folder of a DSpark checkpoint trained for this target',
        )
    return embedded


def _checked(
    model: str | None, target: Any, target_folder: Path | None, threshold: float = 0.0
) -> tuple[DraftCheckpoint, BlockLayout, HeadSpec]:
    from sonar_core.layers.decoder import fused_projections
    from sonar_core.spec_decode.block_layout import block_layout_of, block_target
    from sonar_core.spec_decode.head_loading import HeadSpec, check_head_checkpoint
    from sonar_dspark.heads import DSparkHead

    checkpoint = _checkpoint(model, target_folder)
    layout = block_layout_of(checkpoint, block_target(target))
    spec = HeadSpec(
        build=lambda modules: DSparkHead(layout, modules, threshold),
        fused=fused_projections(layout.layer),
        vocab_size=layout.vocab_size,
        draft_vocab_size=layout.draft_vocab_size,
    )
    check_head_checkpoint(checkpoint, spec)
    return checkpoint, layout, spec


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    from sonar_core.spec_decode.block_proposer import BlockProposer
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_core.spec_decode.head_loading import load_head_checkpoint

    config = context.speculative_config
    options: DSparkOptions = context.method_options
    checkpoint, _, spec = _checked(
        config.model, context.target_modules, context.target_model_dir, options.confidence_threshold
    )
    head, vocab_map = load_head_checkpoint(checkpoint, spec, context.target_modules, context.dtype, context.device)
    return BlockProposer(head, DraftSampler.for_context(vocab_map, context))


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            core_fields=frozenset({"attention_backend", "draft_tensor_parallel_size", "parallel_drafting"}),
            create_proposer=create_proposer,
            description="DSpark: a parallel block sampled left to right through a Markov head",
            options_model=DSparkOptions,
            checkpoint_limits_context=True,
            draft_architectures=(
                DraftArchitecture("Qwen3DSparkModel", DEEPSPEC_DSPARK, "markov_rank, markov_head_type vanilla/gated/rnn, confidence head"),
                DraftArchitecture("DSparkSpeculator", SPECULATORS_DSPARK, "transformer_layer_config (Qwen3), d2t, sample_from_anchor"),
            ),
        )
    )


@hookimpl
def sonar_claim_target_tensors(config: SpeculativeConfig | None, target: TargetInfo) -> list[str] | None:
    """DSpark weights embedded in the target are DSpark's, not the target's, whatever the method."""
    return [EMBEDDED_PREFIX] if EMBEDDED_CONFIG_KEY in target.hf_config else None


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """The block size (the drafts one block makes)."""
    if config.method != METHOD or target is None:
        return None
    return _checked(config.model, target, target.checkpoint_folder)[1].drafts_per_block


@hookimpl
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None, options: DSparkOptions | None
) -> list[str] | None:
    """A drafter in a published layout (or embedded) that fits the target; num_speculative_tokens at
    least the block size; no explicit parallel_drafting; a non-causal attention backend; no
    pipeline stages (the guide's rule, checked here for when the engine has pipelines)."""
    if config.method != METHOD:
        return None
    for error in (parallel_drafting_refused(config), non_causal_backend_refused(config)):
        if error is not None:
            raise error
    if target is None:
        return None
    if target.pipeline_parallel_size > 1:
        raise ConfigError(  # on the method: the engine's pipeline_parallel_size is fine for others
            "method",
            f"DSpark does not support pipeline parallelism; pipeline_parallel_size={target.pipeline_parallel_size}",
            "use tensor parallelism (--tensor-parallel-size) or data parallelism (--data-parallel-size) for a "
            "DSpark deployment",
        )
    checkpoint, layout, _ = _checked(config.model, target, target.checkpoint_folder, options.confidence_threshold)
    if config.num_speculative_tokens < layout.block_size:
        raise ConfigError(
            "num_speculative_tokens",
            f"{checkpoint.describe()} drafts blocks of {layout.block_size}; num_speculative_tokens="
            f"{config.num_speculative_tokens} is smaller, which gives the draft an unsupported layout",
            f"set num_speculative_tokens to at least {layout.block_size}",
        )
    warnings = []
    if options.confidence_threshold > 0 and not layout.config.get("enable_confidence_head"):
        raise ConfigError(
            "confidence_threshold",
            f"{checkpoint.describe()} has no confidence head to cut proposals with",
            "remove confidence_threshold, or use a checkpoint with enable_confidence_head",
        )
    if config.num_speculative_tokens > layout.drafts_per_block:
        warnings.append(
            f"speculative_config.num_speculative_tokens={config.num_speculative_tokens}: {checkpoint.describe()} "
            f"drafts {layout.drafts_per_block} tokens per block; each step drafts at most {layout.drafts_per_block}"
        )
    return warnings
