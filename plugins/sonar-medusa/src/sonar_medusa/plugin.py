"""Hook implementations of ``sonar-medusa``: the ``medusa`` method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.errors import ConfigError
from sonar_core.plugins import DraftArchitecture, MethodSpec, checkpoint_required, hookimpl
from sonar_medusa.layout_names import FASTERDECODING, VLLM

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext
    from sonar_medusa.layout import MedusaLayout

METHOD = "medusa"


class MedusaOptions(BaseModel):
    """Medusa takes only core fields; any other key is rejected."""

    model_config = ConfigDict(extra="forbid")


def _checked(model: str, hidden_size: int, vocab_size: int) -> tuple[DraftCheckpoint, MedusaLayout]:
    """The checkpoint and its layout, every tensor present and of its shape."""
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_medusa.layout import MedusaLayout, read_layout

    checkpoint = DraftCheckpoint.open(model)
    layout = read_layout(checkpoint, hidden_size, vocab_size)
    checkpoint.check_layout(layout.expected(), rename=MedusaLayout.rename)
    return checkpoint, layout


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """Load as many heads as drafts are asked for and draft from all of them at once."""
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
    from sonar_medusa.heads import MedusaProposer, load_heads

    config = context.speculative_config
    target = context.target_modules
    checkpoint, layout = _checked(config.model, target.hidden_size, target.vocab_size)
    heads, token_map = load_heads(checkpoint, layout, config.num_speculative_tokens, context.dtype, context.device)
    vocab_map = (
        DraftVocabularyMap(token_map, layout.vocab_size)
        if token_map is not None
        else DraftVocabularyMap.identity(layout.vocab_size, context.device)
    )
    return MedusaProposer(heads, DraftSampler.for_context(vocab_map, context))


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            create_proposer=create_proposer,
            description="Medusa heads on the target's final hidden state",
            options_model=MedusaOptions,
            draft_architectures=(
                DraftArchitecture("MedusaModel", VLLM, "blocks.{h}.layers.{l}, lm_heads.{h}, token_map"),
                DraftArchitecture(
                    "", FASTERDECODING, "medusa_lm_head.pt; heads counted from the weights", config_key="medusa_num_heads"
                ),
            ),
        )
    )


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """One draft per head the checkpoint holds."""
    if config.method != METHOD or config.model is None or target is None:
        return None
    return _checked(config.model, target.hidden_size or 0, target.vocab_size or 0)[1].num_heads


@hookimpl
def sonar_validate_speculative_config(config: SpeculativeConfig, target: TargetInfo | None) -> list[str] | None:
    """The heads must exist in a published layout, fit the target's hidden size and vocabulary,
    and number at least num_speculative_tokens."""
    if config.method != METHOD:
        return None
    missing = checkpoint_required(config, "trained Medusa heads")
    if missing is not None:
        raise missing
    if target is None:
        return None
    checkpoint, layout = _checked(config.model, target.hidden_size or 0, target.vocab_size or 0)
    if config.num_speculative_tokens > layout.num_heads:
        raise ConfigError(
            "num_speculative_tokens",
            f"{checkpoint.describe()} has {layout.num_heads} heads, one per draft position, and "
            f"num_speculative_tokens={config.num_speculative_tokens} asks for more",
            f"set num_speculative_tokens to at most {layout.num_heads}",
        )
    return None
