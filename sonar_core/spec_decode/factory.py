"""Builds the proposer an engine configuration asks for, through the plugin hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sonar_core.config import ResolvedSpeculativeConfig
from sonar_core.plugins.manager import SonarPluginManager, get_plugin_manager
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
    resolved: ResolvedSpeculativeConfig | None,
    target_model: torch.nn.Module,
    target_hf_config: Any,
    target_tokenizer: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    plugin_manager: SonarPluginManager | None = None,
) -> SpeculatorPlan | None:
    """The proposer for ``resolved`` (None without speculation)."""
    if resolved is None:
        return None
    manager = plugin_manager or get_plugin_manager()
    context = ProposerContext(
        speculative_config=resolved.config,
        method_options=resolved.options,
        target_model=target_model,
        target_hf_config=target_hf_config,
        target_tokenizer=target_tokenizer,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
    )
    proposer = manager.create_proposer(resolved, context)
    return SpeculatorPlan(
        proposer=proposer,
        num_speculative_tokens=resolved.num_speculative_tokens,
        draft_max_model_len=resolved.draft_max_model_len or max_model_len,
        adaptive_depth=resolved.config.depth_policy == "auto",
    )
