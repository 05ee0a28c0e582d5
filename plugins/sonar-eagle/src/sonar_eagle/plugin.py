"""Hook implementations of the ``sonar-eagle`` distribution: the ``eagle`` and ``eagle3`` methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.plugins import DraftArchitecture, MethodSpec, checkpoint_required, hookimpl
from sonar_eagle.layout import SAFEAILAB_EAGLE1, SAFEAILAB_EAGLE3, SPECULATORS_EAGLE3, TargetShape

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHODS = ("eagle", "eagle3")

DRAFT_ARCHITECTURES: dict[str, tuple[DraftArchitecture, ...]] = {
    "eagle": (
        DraftArchitecture("LlamaForCausalLM", SAFEAILAB_EAGLE1, "fc [H, 2H] and Llama layers; target embedding and LM head"),
        DraftArchitecture("EagleLlamaForCausalLM", SAFEAILAB_EAGLE1, "the same, under vLLM's name"),
    ),
    "eagle3": (
        DraftArchitecture("LlamaForCausalLM", SAFEAILAB_EAGLE3, "with draft_vocab_size and midlayer.* tensors"),
        DraftArchitecture("LlamaForCausalLMEagle3", SAFEAILAB_EAGLE3, "midlayer.*, d2t/t2d"),
        DraftArchitecture("Eagle3LlamaForCausalLM", SAFEAILAB_EAGLE3, "midlayer.*, d2t/t2d (vLLM's name)"),
        DraftArchitecture(
            "Eagle3Speculator", SPECULATORS_EAGLE3, "transformer_layer_config of model_type llama, qwen2 or qwen3"
        ),
    ),
}
DESCRIPTIONS = {
    "eagle": "EAGLE-1/2 head on the target's final hidden state",
    "eagle3": "EAGLE-3 head on several target hidden-state layers",
}


class EagleOptions(BaseModel):
    """The EAGLE methods take only core fields (``model``, ``num_speculative_tokens``,
    ``draft_sample_method``, ``max_model_len``); any other key is rejected."""

    model_config = ConfigDict(extra="forbid")


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """Load the head (sharing the target's embedding and LM head where it has none) and drive it
    with core's chain proposer."""
    from sonar_core.spec_decode.chain_proposer import ChainProposer
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_eagle.loading import load_head

    config = context.speculative_config
    checkpoint = DraftCheckpoint.open(config.model)
    head, vocab_map = load_head(checkpoint, config.method, context.target_modules, context.dtype, context.device)
    return ChainProposer(head, DraftSampler.for_context(vocab_map, context))


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    for method in METHODS:
        registry.register(
            MethodSpec(
                name=method,
                create_proposer=create_proposer,
                description=DESCRIPTIONS[method],
                options_model=EagleOptions,
                draft_architectures=DRAFT_ARCHITECTURES[method],
            )
        )


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """A speculators checkpoint's trained depth (``proposal_methods[0].speculative_tokens``)."""
    if config.method not in METHODS or config.model is None:
        return None
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint

    speculators = DraftCheckpoint.open(config.model).speculators
    return speculators.speculative_tokens if speculators is not None else None


@hookimpl
def sonar_validate_speculative_config(config: SpeculativeConfig, target: TargetInfo | None) -> list[str] | None:
    """The head must exist, be in a published layout and fit the target: every tensor present and
    of its shape, the target's hidden size and vocabulary, aux layers inside the target, vocabulary
    maps of draft_vocab_size. Warns when a speculators head names another verifier, or when the
    depth exceeds the one it was trained for."""
    if config.method not in METHODS:
        return None
    missing = checkpoint_required(config, "a trained EAGLE head (SafeAILab or speculators layout)")
    if missing is not None:
        raise missing
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_eagle.loading import check_checkpoint

    checkpoint = DraftCheckpoint.open(config.model)
    if target is None:
        return None
    layout = check_checkpoint(checkpoint, config.method, TargetShape.of(target))
    warnings = []
    if checkpoint.speculators is not None:
        mismatch = checkpoint.speculators.verifier_mismatch(target)
        if mismatch:
            warnings.append(
                f"speculative_config.model: {checkpoint.describe()} may not be trained for this target: {mismatch}. "
                "Similar names do not establish compatibility; a mismatched pair runs losslessly but accepts little."
            )
    depth = config.num_speculative_tokens
    if layout.trained_depth is not None and depth is not None and depth > layout.trained_depth:
        warnings.append(
            f"speculative_config.num_speculative_tokens={depth} is more than the {layout.trained_depth} draft "
            f"tokens {checkpoint.describe()} was trained for; later positions usually accept little"
        )
    return warnings
