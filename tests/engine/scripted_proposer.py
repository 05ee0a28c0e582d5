"""A ``custom_class`` proposer that knows the right continuations and gets a different draft wrong
at each step, so that verification accepts 0, some and all drafts in turn.

Built with ``{"method": "custom_class", "custom_class": "<this file>:ScriptedProposer",
"options": {"continuations": [prompt + expected output, ...]}}``.
"""

from __future__ import annotations

from sonar_core.spec_decode.proposer import (
    DraftBranch,
    DraftProposal,
    ProposalRequest,
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
            wrong = len(request.token_ids) % (request.max_draft_tokens + 1)
            drafts.append(self._drafts_wrong_at(request, wrong))
        return DraftProposal(token_ids=drafts)

    def _drafts_wrong_at(self, request: ProposalRequest, wrong: int) -> list[int]:
        """The continuation's next ``max_draft_tokens`` tokens with the one at index ``wrong`` (if
        any) replaced by another; empty when no continuation starts with the request's tokens."""
        tokens = list(request.token_ids)
        expected = next((c for c in self.continuations if c[: len(tokens)] == tokens), None)
        if expected is None:
            return []
        draft = expected[len(tokens) : len(tokens) + request.max_draft_tokens]
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % self.vocab_size
        return draft


class BranchingScriptedProposer(ScriptedProposer):
    """Drafts ``1 + branches`` chains per request in KV forks: the right continuation sits in the
    chain at index ``len(tokens) % (branches + 2)`` (0: the request's own chain; ``branches + 1``:
    no chain starts right), with a wrong token at index ``(len(tokens) // (branches + 2)) %
    (max_draft_tokens + 1)`` of it (none there: the own chain, where it is the only one that long); every
    other chain starts with a wrong token of its own, and a branch carries one draft fewer than
    the own chain (``max_branch_draft_tokens``). So verification takes each chain and accepts 0,
    some and all of its drafts in turn."""

    capabilities = ProposerCapabilities(max_draft_branches=8)

    def __init__(self, context: ProposerContext, continuations: list[list[int]], branches: int) -> None:
        super().__init__(context, continuations)
        self.branches = branches

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafts: list[list[int]] = []
        branches: list[list[DraftBranch]] = []
        for request in batch.requests:
            tokens = request.token_ids
            wrong = (len(tokens) // (self.branches + 2)) % (request.max_draft_tokens + 1)
            right = self._drafts_wrong_at(request, wrong)
            if not right:
                drafts.append([])
                branches.append([])
                continue
            assert batch.fork is not None
            forks = batch.fork(request, self.branches)
            chains = [[(right[0] + 2 + i) % self.vocab_size] + right[1:] for i in range(len(forks) + 1)]
            # Every draft right, deeper than a branch reaches: the own chain holds them.
            deepest = wrong == request.max_draft_tokens > request.max_branch_draft_tokens
            where = 0 if deepest else len(tokens) % (self.branches + 2)
            if where <= len(forks):
                chains[where] = right
            drafts.append(chains[0])
            shorter = request.max_branch_draft_tokens  # what a fork holds
            branches.append([DraftBranch(chain[:shorter], None, fork) for chain, fork in zip(chains[1:], forks, strict=True)])
        return DraftProposal(token_ids=drafts, branches=branches)
