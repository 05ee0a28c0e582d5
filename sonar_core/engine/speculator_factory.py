"""Builds the proposer an engine configuration asks for, through the plugin hooks."""

from __future__ import annotations

from dataclasses import dataclass

from sonar_core.config import ResolvedSpeculativeConfig
from sonar_core.config.speculative import FIELD
from sonar_core.errors import ConfigError
from sonar_core.plugins.manager import SonarPluginManager
from sonar_core.spec_decode.proposer import Proposer, ProposerCapabilities, ProposerContext


@dataclass
class SpeculatorPlan:
    """A built proposer with the limits the engine applies around it."""

    proposer: Proposer
    num_speculative_tokens: int
    # Drafting stops for requests longer than this (the draft's context limit).
    draft_max_model_len: int
    adaptive_depth: bool

    @property
    def capabilities(self) -> ProposerCapabilities:
        return self.proposer.capabilities


def build_speculator(
    resolved: ResolvedSpeculativeConfig, context: ProposerContext, plugin_manager: SonarPluginManager
) -> SpeculatorPlan:
    """The proposer for ``resolved``, built from ``context`` through the plugin hooks."""
    proposer = plugin_manager.create_proposer(resolved, context)
    _check_branches(resolved, proposer.capabilities)
    return SpeculatorPlan(
        proposer=proposer,
        num_speculative_tokens=resolved.num_speculative_tokens,
        draft_max_model_len=resolved.draft_max_model_len or context.max_model_len,
        adaptive_depth=resolved.config.depth_policy == "auto",
    )


def _check_branches(resolved: ResolvedSpeculativeConfig, capabilities: ProposerCapabilities) -> None:
    """num_draft_branches for a method that reads it needs a proposer that drafts that many chains
    (a method that does not read it was warned about by the configuration rules, and drafts chains)."""
    wanted = resolved.config.num_draft_branches
    if wanted is None:  # unset: the engine gives branches only where the proposer drafts them
        return
    if "num_draft_branches" in resolved.spec.core_fields and wanted > capabilities.max_draft_branches:
        raise ConfigError(
            f"{FIELD}.num_draft_branches",
            f"method {resolved.method}'s proposer drafts at most {capabilities.max_draft_branches} chain(s) per "
            f"request (ProposerCapabilities.max_draft_branches), got {wanted}",
            f"set num_draft_branches to {capabilities.max_draft_branches} or less",
        )
