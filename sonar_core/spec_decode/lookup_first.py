"""Prompt lookup in front of a learned head: copy from the context where it repeats, let the head
draft everywhere else.

Prompt lookup drafts long runs for free where the text copies itself (code edits, quotes, tool
output) and nothing elsewhere; a trained head drafts a few tokens on any text but pays a forward
per draft. :class:`LookupFirstProposer` takes, per request and step, the lookup's draft when the
request's context has a match, and the head's otherwise. The head still runs its first pass over
every request's new positions (a chain head's draft KV must not get holes), but it chains only for
the requests the lookup left without a draft: a request drafted by lookup is handed to the head
with ``max_draft_tokens = 0``.

Losslessness needs nothing special: lookup drafts are one-hot, and when the head drafts with
probabilities the lookup rows are one-hot distributions beside the head's rows, which the
rejection sampler treats exactly (accept with the target's probability of the token, resample from
the residual otherwise).

A plugin opts in by wrapping its proposer when the user sets ``prompt_lookup_min`` or
``prompt_lookup_max`` (sonar-eagle does); the engine sees one proposer with the head's capabilities.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from sonar_core.spec_decode.prompt_lookup import LookupBounds, PromptLookup
from sonar_core.spec_decode.proposer import DraftProposal, ProposalRequest, ProposeBatch, Proposer


class LookupFirstProposer(Proposer):
    """``head``'s drafts where prompt lookup within ``bounds`` finds none (see the module docstring).

    ``vocab_size`` is the target's: the width of a one-hot row when ``head`` returns probabilities.
    ``head_depth`` caps the head's drafts (the depth it was trained for), so that a long
    ``num_speculative_tokens`` lets the lookup copy long runs without making the head chain past
    what it predicts well; None leaves the engine's limit.
    """

    def __init__(self, head: Proposer, bounds: LookupBounds, vocab_size: int, head_depth: int | None = None) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.head_depth = head_depth
        self.capabilities = head.capabilities
        self._lookup = PromptLookup(bounds)

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        looked_up = [self._look_up(request) for request in batch.requests]
        head_batch = replace(
            batch,
            requests=[
                replace(request, max_draft_tokens=0 if drafts else self._head_limit(request))
                for request, drafts in zip(batch.requests, looked_up, strict=True)
            ],
        )
        proposal = self.head.propose(head_batch)
        token_ids = [drafts or head for drafts, head in zip(looked_up, proposal.token_ids, strict=True)]
        # Only requests the head drafted for have branches (each in a fork made for the head's request).
        return DraftProposal(
            token_ids, self._probs(proposal, looked_up, token_ids, batch.device), branches=proposal.branches
        )

    def _head_limit(self, request: ProposalRequest) -> int:
        if self.head_depth is None:
            return request.max_draft_tokens
        return min(request.max_draft_tokens, self.head_depth)

    def _look_up(self, request: ProposalRequest) -> list[int]:
        """The lookup's draft for ``request`` (empty: no match, or nothing to draft). Every request
        is seen, drafting or not, so the lookup's history keeps up with its tokens."""
        drafting = request.max_draft_tokens > 0 and not request.is_finished and not request.is_partial_prefill
        limit = request.max_draft_tokens if drafting else 0
        return self._lookup.draft(request.request_id, request.token_ids, request.num_new_tokens, limit).tokens

    def _probs(
        self,
        proposal: DraftProposal,
        looked_up: list[list[int]],
        token_ids: list[list[int]],
        device: torch.device | None,
    ) -> torch.Tensor | None:
        """The head's probability rows with one-hot rows for the lookup's drafts, in request order."""
        if not self.capabilities.returns_draft_probs:
            return None
        rows: list[torch.Tensor] = []
        head_row = 0
        for drafts, final in zip(looked_up, token_ids, strict=True):
            if drafts:
                one_hot = torch.zeros(len(drafts), self.vocab_size, device=device)
                rows.append(one_hot.scatter_(1, torch.tensor(drafts, device=device)[:, None], 1.0))
            elif final:
                rows.append(proposal.probs[head_row : head_row + len(final)])
                head_row += len(final)
        if not rows:
            return None
        return torch.cat([row.float() for row in rows])

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._lookup.add(request_id, prompt_token_ids)
        self.head.add_request(request_id, prompt_token_ids)

    def finish_request(self, request_id: str, token_ids: list[int]) -> None:
        self.head.finish_request(request_id, token_ids)

    def remove_request(self, request_id: str) -> None:
        self._lookup.remove(request_id)
        self.head.remove_request(request_id)

    def discard_request(self, request_id: str) -> None:
        self._lookup.remove(request_id)
        self.head.discard_request(request_id)
