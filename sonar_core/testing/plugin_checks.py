"""Checks a method plugin's own tests share: its configuration rules against a real target, and
its drafts against a reference forward written from the published layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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


def check_drafts_from_states(
    llm: Any,
    prompts: list[list[int]],
    states: Callable[[Any], torch.Tensor],
    reference: Callable[[list[int], torch.Tensor, int], list[int]],
) -> int:
    """:func:`check_drafts` against a reference forward over the whole context: every target state
    the engine hands the proposer (``states(batch.target_hidden)``, e.g. ``lambda h: h.final``) is
    kept per request and position, and ``reference(token_ids, rows, max_draft_tokens)`` gets the
    ``[len(token_ids) - 1, ...]`` states of every committed position, prefill chunks included."""
    proposer = llm.engine.speculator.proposer
    original = proposer.propose
    kept: dict[str, dict[int, torch.Tensor]] = {}

    def remembering(batch: ProposeBatch) -> Any:  # before the proposer (and check_drafts) sees it
        rows = states(batch.target_hidden)
        for request in batch.requests:
            known = kept.setdefault(request.request_id, {})
            for offset, row in enumerate(range(request.hidden_rows.start, request.hidden_rows.stop)):
                known[request.hidden_start + offset] = rows[row].clone()
        return original(batch)

    def expected(batch: ProposeBatch, request: ProposalRequest) -> list[int]:
        known = kept[request.request_id]
        rows = torch.stack([known[position] for position in range(len(request.token_ids) - 1)])
        return reference(request.token_ids, rows, request.max_draft_tokens)

    proposer.propose = remembering
    try:
        return check_drafts(llm, prompts, expected)
    finally:
        proposer.propose = original
