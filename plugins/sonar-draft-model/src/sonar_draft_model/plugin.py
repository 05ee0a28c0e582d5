"""Hook implementations of the ``draft_model`` method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.config import SpeculativeConfig, TargetInfo
from sonar_core.config.parallel import check_tensor_parallel
from sonar_core.errors import ConfigError
from sonar_core.models.registry import RECURRENT_ARCHITECTURES, supported_architectures
from sonar_core.plugins import DraftArchitecture, MethodRegistry, MethodSpec, hookimpl

if TYPE_CHECKING:
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "draft_model"


class DraftModelOptions(BaseModel):
    """The method has no options beyond the core fields; unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """Load the draft checkpoint (or take the one loaded by the weights hook) and wrap it."""
    # Imported here: registering the method (every configuration check) must not import torch.
    from sonar_core.models.loader import load_model, load_tokenizer
    from sonar_draft_model.proposer import DraftModelProposer
    from sonar_draft_model.vocab import VocabularyIntersection

    config = context.speculative_config
    draft_args = dict(model=config.model, dtype=context.dtype, device=context.device, field="speculative_config.model")
    if context.split_draft is not None:  # split over the target's ranks
        loaded = context.split_draft.load_model(**draft_args)
    else:
        loaded = (weights or {}).get("draft") or load_model(**draft_args)
    vocab = None
    if config.use_heterogeneous_vocab:
        vocab = VocabularyIntersection(context.target_tokenizer, load_tokenizer(loaded), context.device)
    return DraftModelProposer(
        loaded.model,
        context.device,
        probabilistic=config.draft_sample_method == "probabilistic",
        vocab=vocab,
        max_positions=config.max_model_len,
    )


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            core_fields=frozenset({"attention_backend", "draft_tensor_parallel_size", "use_heterogeneous_vocab"}),
            create_proposer=create_proposer,
            description="A smaller causal language model drafts autoregressively",
            options_model=DraftModelOptions,
            checkpoint_limits_context=True,
            draft_architectures=tuple(
                DraftArchitecture(name, "Hugging Face causal LM (or GGUF)", "any checkpoint Sonar runs as a target")
                for name in supported_architectures()
                if name not in RECURRENT_ARCHITECTURES
            ),
        )
    )


@hookimpl
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None
) -> list[str] | None:
    """The draft checkpoint must exist, be a supported architecture and share the vocabulary."""
    if config.method != METHOD:
        return None
    if not config.model:
        raise ConfigError(
            field="model",
            message="draft_model drafts with a separate checkpoint, and none was given",
            fix='set "model" to the draft checkpoint (a folder with config.json or a .gguf file)',
        )
    draft = TargetInfo.from_model(config.model)
    check_tensor_parallel(
        draft.hf_config, config.draft_tensor_parallel_size or 1, draft.source,
        field="speculative_config.draft_tensor_parallel_size",
    )
    if target is not None and draft.vocab_size != target.vocab_size and not config.use_heterogeneous_vocab:
        raise ConfigError(
            field="model",
            message=(
                f"the draft vocabulary has {draft.vocab_size} tokens and the target's has "
                f"{target.vocab_size}; draft_model needs the same vocabulary"
            ),
            fix='use a draft of the same model family, or set "use_heterogeneous_vocab": true '
            "(greedy drafting through the tokens both vocabularies share)",
        )
    return None
