"""Autoregressive drafting with a smaller causal model whose KV lives in the engine's paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sonar_core.layers.attention import AttentionMetadata
from sonar_core.sample.processing import processed_probs
from sonar_core.sample.sampler import SamplingBatch
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
)
from sonar_draft_model.vocab import VocabularyIntersection

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _RequestState:
    # Leading positions whose draft-layer KV matches the request's accepted tokens.
    committed: int = 0
    # Drafts proposed last step; those the target accepted already have valid draft KV.
    last_drafts: list[int] = field(default_factory=list)
    last_length: int = 0


class DraftModelProposer(Proposer):
    """Runs the draft model over each request's new tokens, then k-1 single-token steps.

    The draft's KV layers share every request's block table with the target, so they are
    allocated, preempted and freed with the request. Positions of rejected drafts are rewritten on
    the next call, which is the draft's rollback; accepted drafts keep their KV.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        probabilistic: bool,
        vocab: VocabularyIntersection | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.probabilistic = probabilistic
        self.vocab = vocab
        self.capabilities = ProposerCapabilities(
            kv_layers=tuple(model.kv_cache_specs()), returns_draft_probs=probabilistic
        )
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._states[request_id] = _RequestState()

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        active = [i for i, r in enumerate(batch.requests) if r.max_draft_tokens > 0]
        drafts: list[list[int]] = [[] for _ in batch.requests]
        probs: list[list[torch.Tensor]] = [[] for _ in batch.requests]
        if not active:
            return DraftProposal(drafts, self._stack(drafts, probs))
        requests = [batch.requests[i] for i in active]
        # First pass: catch the draft's KV up over tokens it has not seen, then draft one token.
        chunks = [r.token_ids[self._reusable_prefix(r) :] for r in requests]
        logits = self._forward(batch, requests, chunks)
        for step in range(max(r.max_draft_tokens for r in requests)):
            if step > 0:
                live = [j for j, r in enumerate(requests) if r.max_draft_tokens > step]
                feed = [[drafts[active[j]][-1]] for j in live]
                logits = self._forward(batch, [requests[j] for j in live], feed, offset=step)
                rows = live
            else:
                rows = list(range(len(requests)))
            tokens, token_probs = self._pick(logits, [requests[j] for j in rows])
            for row, j in enumerate(rows):
                drafts[active[j]].append(tokens[row])
                if token_probs is not None:
                    probs[active[j]].append(token_probs[row])
        for j, r in enumerate(requests):
            state = self._states[r.request_id]
            state.committed = len(r.token_ids)
            state.last_drafts = drafts[active[j]]
            state.last_length = len(r.token_ids)
        return DraftProposal(drafts, self._stack(drafts, probs))

    def _reusable_prefix(self, request: ProposalRequest) -> int:
        """Positions whose draft KV is still valid: committed ones plus accepted earlier drafts.

        Drafts d1..d(k-1) were fed to the draft model at positions n..n+k-2 last step; each one the
        target accepted, in order, left correct KV behind.
        """
        state = self._states[request.request_id]
        tokens = request.token_ids
        reusable = state.committed
        for position, draft in enumerate(state.last_drafts[:-1], start=state.last_length):
            if position >= len(tokens) - 1 or tokens[position] != draft:
                break
            reusable = position + 1
        return min(reusable, len(tokens) - 1)

    def _forward(
        self,
        batch: ProposeBatch,
        requests: list[ProposalRequest],
        chunks: list[list[int]],
        offset: int = 0,
    ) -> torch.Tensor:
        """Run the draft over one chunk per request, ending at position len(token_ids)-1+offset.

        Returns the draft logits of each chunk's last token.
        """
        seq_lens = [len(r.token_ids) + offset for r in requests]
        query_lens = [len(c) for c in chunks]
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, [r.block_table for r in requests], batch.block_size, self.device
        )
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        if self.vocab is not None:
            ids = self.vocab.to_draft(ids)
        hidden = self.model(ids, metadata.positions, batch.kv_caches, metadata)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last))
        if self.vocab is not None:
            logits = self.vocab.mask_logits(logits)
        return logits

    def _pick(
        self, logits: torch.Tensor, requests: list[ProposalRequest]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Greedy argmax, or a sample from the draft distribution shaped like the target's.

        Probabilistic drafts use the request's own temperature/top-k/top-p/min-p, so a draft that
        equals the target proposes from exactly the distribution the target verifies against.
        Greedy requests draft their argmax with a one-hot probability.
        """
        greedy = logits.argmax(dim=-1)
        if not self.probabilistic:
            return self._to_target(greedy), None
        params = [self._draft_params(r) for r in requests]
        sampling = SamplingBatch.from_params(params, [r.generator for r in requests], self.device)
        probs = processed_probs(logits.float(), sampling)
        tokens = greedy.clone()
        for row, (p, request) in enumerate(zip(params, requests, strict=True)):
            if p.is_greedy:
                probs[row] = torch.nn.functional.one_hot(greedy[row], probs.shape[-1]).to(probs.dtype)
            else:
                tokens[row] = torch.multinomial(probs[row], 1, generator=request.generator).squeeze(0)
        return self._to_target(tokens), probs

    def _to_target(self, draft_ids: torch.Tensor) -> list[int]:
        if self.vocab is not None:
            draft_ids = self.vocab.to_target(draft_ids)
        return draft_ids.tolist()

    def _draft_params(self, request: ProposalRequest) -> SamplingParams:
        return request.params if request.params is not None else _GREEDY

    @staticmethod
    def _stack(drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> torch.Tensor | None:
        rows = [p for per_request in probs for p in per_request]
        if not rows:
            return None
        return torch.stack(rows)
