"""A ``custom_class`` proposer that knows the right continuations and gets a different draft wrong
at each step, so that verification accepts 0, some and all drafts in turn.

Built with ``{"method": "custom_class", "custom_class": "<this file>:ScriptedProposer",
"options": {"continuations": [prompt + expected output, ...]}}``.
"""

from __future__ import annotations

from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    ProposerContext,
)


class ScriptedProposer(Proposer):
    """Drafts the expected next tokens of the continuation the request's tokens start, with the
    draft at index ``len(tokens) % (max_draft_tokens + 1)`` replaced by a wrong token (none when
    that index is past the drafts: then every draft is right)."""

    capabilities = ProposerCapabilities()

    def __init__(self, context: ProposerContext, continuations: list[list[int]]) -> None:
        self.continuations = [list(tokens) for tokens in continuations]
        self.vocab_size = context.target_hf_config.vocab_size

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafts = []
        for request in batch.requests:
            tokens = list(request.token_ids)
            expected = next((c for c in self.continuations if c[: len(tokens)] == tokens), None)
            if expected is None:
                drafts.append([])
                continue
            draft = expected[len(tokens) : len(tokens) + request.max_draft_tokens]
            wrong = len(tokens) % (request.max_draft_tokens + 1)
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.vocab_size
            drafts.append(draft)
        return DraftProposal(token_ids=drafts)
