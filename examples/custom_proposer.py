"""A proposer for the ``custom_class`` method: drafts the continuation of a run of one token.

When the last ``min_run`` tokens are the same token (a row of ``=``, spaces of indentation, a
padding token), it drafts more of that token; otherwise it drafts nothing and the step costs the
same as plain decoding.

Use it without packaging anything::

    aphrodite serve --speculative-config '{"method": "custom_class",
        "custom_class": "examples/custom_proposer.py:RepeatRunProposer",
        "num_speculative_tokens": 4, "options": {"min_run": 3}}'

or, with this folder on PYTHONPATH, ``"custom_class": "custom_proposer:RepeatRunProposer"``.
"""

from __future__ import annotations

from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    ProposerContext,
)


class RepeatRunProposer(Proposer):
    """Built by Sonar as ``RepeatRunProposer(context, **options)``."""

    # Token ids are all it reads: no target hidden states, no KV cache of its own, one-hot drafts.
    capabilities = ProposerCapabilities()

    def __init__(self, context: ProposerContext, min_run: int = 2) -> None:
        if min_run < 1:
            raise ValueError(f"min_run must be at least 1, got {min_run}")
        self.min_run = min_run

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafts = []
        for request in batch.requests:
            tail = request.token_ids[-self.min_run :]
            in_run = len(tail) == self.min_run and len(set(tail)) == 1
            drafts.append([tail[-1]] * request.max_draft_tokens if in_run else [])
        return DraftProposal(token_ids=drafts)
