"""Drafting from the target's newest final state alone (Medusa heads, the MLP speculator).

Such heads keep no KV cache and see no earlier position: each drafting request's draft comes from
the final, post-norm state at the newest position the target read (the state that predicted the
newest token) and, for heads that condition on it, that newest token. :class:`StateHeadProposer`
gathers those per step and turns the head's per-position samples into the engine's proposal; a
method supplies :meth:`StateHeadProposer.draft`.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from sonar_core.sample.processing import SamplingBatch
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler
from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch, Proposer, ProposerCapabilities


class StateHeadProposer(Proposer):
    """A proposer whose drafts depend only on the newest final state and token of a request."""

    def __init__(self, sampler: DraftSampler, max_depth: int | None) -> None:
        self.sampler = sampler
        self.capabilities = ProposerCapabilities(
            target_final_hidden=True, returns_draft_probs=sampler.probabilistic, max_depth=max_depth
        )

    @abstractmethod
    def draft(
        self, states: torch.Tensor, newest_tokens: torch.Tensor, depth: int, sampling: SamplingBatch | None
    ) -> list[DraftSample]:
        """``depth`` draft positions for ``[R, H]`` final states and ``[R]`` newest token ids (target
        vocabulary): one :class:`DraftSample` per position, sampled with ``self.sampler``."""

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafting = [r for r in batch.requests if r.max_draft_tokens > 0 and r.num_hidden_rows]
        if not drafting or batch.target_hidden is None or batch.target_hidden.final is None:
            return DraftProposal([[] for _ in batch.requests])
        states = batch.target_hidden.final.index_select(0, batch.last_row_index(drafting))
        newest = torch.tensor([r.token_ids[-1] for r in drafting], dtype=torch.int64, device=batch.device)
        depth = max(r.max_draft_tokens for r in drafting)
        samples = self.draft(states, newest, depth, self.sampler.batch_for(drafting))
        token_rows = torch.stack([s.token_ids for s in samples], dim=1).tolist()
        probs = torch.stack([s.probs for s in samples], dim=1) if samples[0].probs is not None else None
        return DraftProposal.from_rows(batch.requests, drafting, token_rows, probs)
