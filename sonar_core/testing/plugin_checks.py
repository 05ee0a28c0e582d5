"""Checks a method plugin's own tests share: its configuration rules against a real target, and
its drafts against a reference forward written from the published layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch


def validate_for_target(target: Path, entry_point: str, **fields: Any) -> Any:
    """``validate_speculative_config(fields)`` against the target in ``target``, with only the
    plugin behind ``entry_point`` loaded (or those of a comma-separated list); returns the resolved configuration (warnings not logged)."""
    from sonar_core.config import target_info_for, validate_speculative_config
    from sonar_core.plugins import get_plugin_manager

    manager = get_plugin_manager(environ={"SONAR_PLUGINS": entry_point})
    return validate_speculative_config(fields, target_info_for(str(target)), manager, log_warnings=False)


def check_drafts(
    llm: Any,
    prompts: list[list[int]],
    expected: Callable[[ProposeBatch, ProposalRequest], list[int]],
    max_tokens: int = 12,
) -> int:
    """Generate greedily and compare every draft the proposer makes with ``expected(batch, request)``,
    computed during the proposer's call (while the batch's target states are valid).

    Returns how many drafting requests were compared; raises AssertionError at the first difference.
    """
    from sonar_core.sampling_params import SamplingParams

    proposer = llm.engine.speculator.proposer
    original = proposer.propose
    compared = 0

    def checking(batch: ProposeBatch) -> Any:
        nonlocal compared
        proposal = original(batch)
        for request, drafts in zip(batch.requests, proposal.token_ids, strict=True):
            if request.max_draft_tokens:
                reference = expected(batch, request)
                assert drafts == reference, f"drafts {drafts} != reference {reference} after {len(request.token_ids)} tokens"
                compared += 1
        return proposal

    proposer.propose = checking
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        proposer.propose = original
    return compared
