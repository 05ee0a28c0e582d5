"""The bigram proposer: drafts by following the most frequent successor of the last token.

For each request it counts which token followed which (in the prompt and in every accepted token);
a draft starts at the last token and repeatedly takes the most frequent successor (the most recent
one on a tie), stopping where the table knows no successor seen at least ``min_count`` times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch, Proposer, ProposerCapabilities


@dataclass
class BigramTable:
    """Successor counts, with the best successor of each token kept up to date."""

    counts: dict[tuple[int, int], int] = field(default_factory=dict)
    best: dict[int, tuple[int, int]] = field(default_factory=dict)  # token -> (successor, count)

    def learn(self, tokens: list[int]) -> None:
        """Count every adjacent pair of ``tokens``."""
        for first, second in pairwise(tokens):
            count = self.counts.get((first, second), 0) + 1
            self.counts[(first, second)] = count
            if count >= self.best.get(first, (second, 0))[1]:
                self.best[first] = (second, count)

    def follow(self, token: int, length: int, min_count: int) -> list[int]:
        """Up to ``length`` tokens that follow ``token`` along the best successors."""
        draft: list[int] = []
        while len(draft) < length:
            successor, count = self.best.get(token, (token, 0))
            if count < min_count:
                break
            draft.append(successor)
            token = successor
        return draft


class BigramProposer(Proposer):
    """Needs nothing from the engine beyond token ids: the default capabilities say so (no target
    hidden states, no KV layers of its own, one-hot drafts, one token per pass)."""

    capabilities = ProposerCapabilities()

    def __init__(self, min_count: int = 1, share_across_requests: bool = False) -> None:
        self.min_count = min_count
        self.share_across_requests = share_across_requests
        self._shared = BigramTable()
        self._tables: dict[str, BigramTable] = {}
        # Tokens of each request already counted, so that each step counts only new pairs.
        self._counted: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._tables[request_id] = self._shared if self.share_across_requests else BigramTable()
        self._counted[request_id] = 0

    def remove_request(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
        self._counted.pop(request_id, None)

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafts: list[list[int]] = []
        for request in batch.requests:
            if request.request_id not in self._tables:
                self.add_request(request.request_id, request.token_ids)
            table = self._tables[request.request_id]
            tokens = request.token_ids
            # Include the last counted token so that the pair across the boundary is counted.
            start = max(self._counted[request.request_id] - 1, 0)
            table.learn(tokens[start:])
            self._counted[request.request_id] = len(tokens)
            if request.max_draft_tokens <= 0 or not tokens:
                drafts.append([])
                continue
            drafts.append(table.follow(tokens[-1], request.max_draft_tokens, self.min_count))
        return DraftProposal(token_ids=drafts)
