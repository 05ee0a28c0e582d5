"""Hook implementations of ``sonar-dflash``: the ``dflash`` method.

The draft config is the source of the mask token, the target hidden-state layers, the attention
mode (non-causal unless it says ``causal``) and the anchor mode (z-lab's bonus-anchored blocks, or
speculators' ``sample_from_anchor``). A block drafts at most ``block_size - 1`` tokens bonus-anchored
(``block_size`` from the anchor); a smaller ``num_speculative_tokens`` keeps the block the checkpoint
was trained on and cuts the proposal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.errors import ConfigError
from sonar_core.plugins import (
    DraftArchitecture,
    MethodSpec,
    checkpoint_required,
    hookimpl,
    non_causal_backend_refused,
    parallel_drafting_refused,
)
from sonar_core.spec_decode.layout_names import DEEPSPEC_DSPARK, SPECULATORS_DFLASH, ZLAB_DFLASH

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.block_layout import BlockLayout
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.head_loading import HeadSpec
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "dflash"


class DFlashOptions(BaseModel):
    """DFlash takes only core fields; any other key is rejected."""

    model_config = ConfigDict(extra="forbid")


def _checked(model: str, target: Any) -> tuple[DraftCheckpoint, BlockLayout, HeadSpec]:
    """The checkpoint, its layout and how to build its head, every tensor checked."""
    from sonar_core.layers.decoder import fused_projections
    from sonar_core.spec_decode.block_layout import block_layout_of, block_target
    from sonar_core.spec_decode.block_proposer import BlockDraftHead
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.head_loading import HeadSpec, check_head_checkpoint

    checkpoint = DraftCheckpoint.open(model)
    layout = block_layout_of(checkpoint, block_target(target))
    if int(layout.config.get("markov_rank") or 0) > 0:
        raise ConfigError(
            "model",
            f"{checkpoint.describe()} is a DSpark drafter (markov_rank {layout.config['markov_rank']})",
            'use "method": "dspark" for it',
        )
    spec = HeadSpec(
        build=lambda modules: BlockDraftHead(layout, modules),
        fused=fused_projections(layout.layer),
        vocab_size=layout.vocab_size,
        draft_vocab_size=layout.draft_vocab_size,
        skipped=lambda name: name.startswith("confidence_head."),
    )
    check_head_checkpoint(checkpoint, spec)
    return checkpoint, layout, spec


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    from sonar_core.spec_decode.block_proposer import BlockProposer
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_core.spec_decode.head_loading import load_head_checkpoint

    config = context.speculative_config
    checkpoint, _, spec = _checked(config.model, context.target_modules)
    head, vocab_map = load_head_checkpoint(checkpoint, spec, context.target_modules, context.dtype, context.device)
    return BlockProposer(head, DraftSampler.for_context(vocab_map, context))


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            core_fields=frozenset({"attention_backend", "draft_tensor_parallel_size", "parallel_drafting"}),
            create_proposer=create_proposer,
            description="DFlash: a block of drafts in one non-causal pass over the target's hidden states",
            options_model=DFlashOptions,
            checkpoint_limits_context=True,
            draft_architectures=(
                DraftArchitecture("DFlashDraftModel", ZLAB_DFLASH, "Qwen3 layers, dflash_config; the target's embedding and LM head"),
                DraftArchitecture("DFlashSpeculator", SPECULATORS_DFLASH, "transformer_layer_config (Qwen3), d2t"),
                DraftArchitecture("Qwen3DSparkModel", DEEPSPEC_DSPARK, "markov_rank 0 only (DeepSpec's dflash_*_block7)"),
            ),
        )
    )


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """The drafts one block makes (or the speculators checkpoint's trained depth)."""
    if config.method != METHOD or config.model is None or target is None:
        return None
    layout = _checked(config.model, target)[1]
    return layout.trained_depth or layout.drafts_per_block


@hookimpl
def sonar_validate_speculative_config(config: SpeculativeConfig, target: TargetInfo | None) -> list[str] | None:
    """A drafter in a published layout that fits the target; no explicit parallel_drafting; an
    attention backend that attends non-causally when the drafter does; a warning when more drafts
    are asked for than a block makes."""
    if config.method != METHOD:
        return None
    for error in (checkpoint_required(config, "a trained DFlash block drafter"), parallel_drafting_refused(config)):
        if error is not None:
            raise error
    if target is None:
        return None
    checkpoint, layout, _ = _checked(config.model, target)
    if not layout.causal:
        refused = non_causal_backend_refused(config)
        if refused is not None:
            raise refused
    if config.num_speculative_tokens > layout.drafts_per_block:
        return [
            f"speculative_config.num_speculative_tokens={config.num_speculative_tokens}: {checkpoint.describe()} "
            f"drafts {layout.drafts_per_block} tokens per block of {layout.block_size}; each step drafts at most "
            f"{layout.drafts_per_block}"
        ]
    return None
