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
# Core fields that only the n-gram methods read; with suffix they would be silently ignored.
_NGRAM_ONLY_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")


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
    warnings: list[str] = []
    for field in _NGRAM_ONLY_FIELDS:
        if getattr(config, field) is not None:
            warnings.append(
                f"{field} has no effect with method 'suffix': it matches contexts of every length up to "
                f"suffix_decoding_max_tree_depth; remove {field}"
            )
    one_hot = one_hot_drafts_warning(config)
    return [*warnings, one_hot] if one_hot else warnings
