"""Hook implementations: what Sonar calls in this plugin.

Sonar finds this module through the entry point ``bigram`` of the group ``sonar`` (pyproject.toml)
and calls the functions marked ``@hookimpl`` whose names match its hook specifications.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from sonar_core.plugins import MethodSpec, checkpoint_refused, hookimpl, one_hot_drafts_warning

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "bigram"


class BigramOptions(BaseModel):
    """The method's own keys in ``speculative_config``; ``extra="forbid"`` turns a typo into an error
    that names the key and the method."""

    model_config = ConfigDict(extra="forbid")

    min_count: int = Field(1, ge=1, description="Follow a successor only after seeing it this often.")
    share_across_requests: bool = Field(
        False, description="Learn one table from every request instead of one table per request."
    )


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """Sonar's default ``sonar_create_proposer`` calls this with the validated options."""
    # Imported here so that listing plugins does not import torch.
    from sonar_example_plugin.proposer import BigramProposer

    options: BigramOptions = context.method_options
    return BigramProposer(min_count=options.min_count, share_across_requests=options.share_across_requests)


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            create_proposer=create_proposer,
            description="Follows the most frequent successor of the last token (example plugin)",
            options_model=BigramOptions,
        ),
        aliases=("bigram_table",),
    )


@hookimpl
def sonar_validate_speculative_config(config: SpeculativeConfig, target: TargetInfo | None) -> list[str] | None:
    """The method's rules. Other methods' configurations are not this plugin's business."""
    if config.method != METHOD:
        return None
    # Sonar's shared wording for a method that needs no checkpoint and drafts without probabilities.
    refused = checkpoint_refused(config, "a bigram table of the request's own tokens")
    if refused is not None:
        raise refused
    warning = one_hot_drafts_warning(config)
    return [warning] if warning else None
