"""Hook implementations of the ``sonar-suffix`` distribution (entry point ``suffix`` in group ``sonar``).

This module imports neither arctic-inference nor numpy: the method is registered, and listed by
``aphrodite plugins``, even where the library is missing, and choosing it then fails while the
configuration is validated, with the command that installs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sonar_core.plugins import MethodSpec, checkpoint_refused, hookimpl, one_hot_drafts_warning
from sonar_suffix.dependency import check_arctic_inference
from sonar_suffix.options import SuffixOptions

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "suffix"


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """Build the proposer, importing arctic-inference only now (validation has checked it imports)."""
    from sonar_suffix.proposer import create_suffix_proposer

    return create_suffix_proposer(context, weights)


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            create_proposer=create_proposer,
            description="Prompt and response suffix trees",
            options_model=SuffixOptions,
        )
    )


@hookimpl
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None
) -> list[str] | None:
    if config.method != METHOD:
        return None
    refused = checkpoint_refused(config, "suffix trees of prompts and earlier responses")
    if refused is not None:
        raise refused
    check_arctic_inference()
    # prompt_lookup_* and other fields suffix does not read are warned about by core.
    one_hot = one_hot_drafts_warning(config)
    return [one_hot] if one_hot else []
