"""Autoregressive drafting with a smaller causal model whose KV lives in the engine's paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sonar_core.layers.attention import AttentionMetadata
from sonar_core.sample.greedy import argmax_rows
from sonar_core.sample.processing import SamplingBatch
from sonar_core.spec_decode.draft_attention import DraftChain
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler
from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    drafting_last_rows,
)
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
from sonar_draft_model.vocab import VocabularyIntersection


@dataclass
class _RequestState:
    # Leading positions whose draft-layer KV matches the request's accepted tokens; None until
    # the first call, which starts after the positions the request found in the prefix cache.
    committed: int | None = None
    # Drafts proposed last step; those the target accepted already have valid draft KV.
    last_drafts: list[int] = field(default_factory=list)
    last_length: int = 0


class DraftModelProposer(Proposer):
    """Runs the draft model over each request's new tokens, then k-1 single-token steps.

    The draft's KV layers share every request's block table with the target, so they are
    allocated, preempted and freed with the request. Positions of rejected drafts are rewritten on
    the next call, which is the draft's rollback; accepted drafts keep their KV. The k-1 chained
    steps advance their attention metadata on the device and read the drafts back once.

    A request that does not draft this step (a prefill chunk, no draft budget, or it ended) still
    has its draft KV caught up to the end of its last full block: so every full block holds its draft KV by the
    end of the step where the target filled it, from the tokens up to it, and a prefix-cached block
    holds the draft KV a request that hits it would write (``prefix_cache_lookahead=0``). The
    catch-up runs once per block, not per step, so a request whose drafting pauses costs little.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        probabilistic: bool,
        vocab: VocabularyIntersection | None = None,
        max_positions: int | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.vocab = vocab
        # Positions the draft serves (its context limit): a request past it drafts no more.
        self.max_positions = max_positions
        # A draft of another vocabulary drafts greedily through the shared tokens (its own path);
        # one of the target's vocabulary uses core's sampler.
        self.sampler = (
            None
            if vocab is not None
            else DraftSampler(DraftVocabularyMap.identity(model.shared_modules().vocab_size, device), probabilistic, device)
        )
        self.capabilities = ProposerCapabilities(
            kv_layers=tuple(model.kv_cache_specs()), returns_draft_probs=probabilistic, prefix_cache_lookahead=0
        )
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._states[request_id] = _RequestState()

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        # First pass: catch the draft's KV up over the tokens it has not seen (see
        # _catch_up_end), then draft one token for each drafting request.
        # A request that ended this step catches up too: its full blocks may be in the prefix cache.
        spans = {r.request_id: (self._reusable_prefix(r), self._catch_up_end(r, batch.block_size)) for r in batch.requests}
        catching_up = [r for r in batch.requests if spans[r.request_id][1] > spans[r.request_id][0]]
        requests = [r for r in catching_up if r.max_draft_tokens > 0]
        if not catching_up:
            return DraftProposal([[] for _ in batch.requests])
        chunks = [r.token_ids[slice(*spans[r.request_id])] for r in catching_up]
        hidden = self._first_pass(batch, catching_up, chunks, [spans[r.request_id][1] for r in catching_up])
        for request in catching_up:
            if not request.max_draft_tokens:
                self._states[request.request_id] = _RequestState(committed=spans[request.request_id][1])
        if not requests:
            return DraftProposal([[] for _ in batch.requests])
        last = drafting_last_rows([len(c) for c in chunks], catching_up, self.device)
        logits = self._masked(self.model.compute_logits(hidden.index_select(0, last)))
        sampling = self.sampler.batch_for(requests) if self.sampler is not None else None
        draft_ids, sample = self._pick(logits, sampling)
        steps_ids, steps_probs = [sample.token_ids], [sample.probs]
        depth = max(r.max_draft_tokens for r in requests)
        if depth > 1:
            # Draft j (j >= 2) is read at position len(token_ids) + j - 2; a request whose chain is
            # shorter than the batch's rewrites one position past its last draft, which no later
            # step reuses.
            chain = DraftChain(
                [len(r.token_ids) for r in requests],
                [len(r.token_ids) + r.max_draft_tokens - 1 for r in requests],
                [r.block_table for r in requests],
                batch.block_size,
                self.device,
            )
            for _ in range(1, depth):
                metadata = chain.metadata()
                hidden = self.model(draft_ids, chain.positions, batch.kv_caches, metadata)
                draft_ids, sample = self._pick(self._masked(self.model.compute_logits(hidden)), sampling)
                steps_ids.append(sample.token_ids)
                steps_probs.append(sample.probs)
                chain.advance()
        token_rows = torch.stack(steps_ids, dim=1).tolist()
        probs = torch.stack(steps_probs, dim=1) if steps_probs[0] is not None else None
        return self._proposal(batch.requests, requests, token_rows, probs)

    def _proposal(
        self,
        all_requests: list[ProposalRequest],
        drafting: list[ProposalRequest],
        token_rows: list[list[int]],
        probs: torch.Tensor | None,
    ) -> DraftProposal:
        """The batch's proposal; each drafting request remembers its drafts for the next catch-up."""
        proposal = DraftProposal.from_rows(all_requests, drafting, token_rows, probs)
        for request, tokens in zip(all_requests, proposal.token_ids, strict=True):
            if request.max_draft_tokens:
                state = self._states[request.request_id]
                state.committed = len(request.token_ids)
                state.last_drafts = tokens
                state.last_length = len(request.token_ids)
        return proposal

    def _catch_up_end(self, request: ProposalRequest, block_size: int) -> int:
        """One past the last position whose draft KV this step's first pass writes: a drafting
        request's newest token (the engine reserved its slot); for another, the end of the last
        full block the target has run, within the draft's context limit."""
        if request.max_draft_tokens > 0:
            return len(request.token_ids)
        end = (request.hidden_start + request.num_hidden_rows) // block_size * block_size
        return end if self.max_positions is None else min(end, self.max_positions)

    def _reusable_prefix(self, request: ProposalRequest) -> int:
        """Positions whose draft KV is still valid: committed ones plus accepted earlier drafts.

        Drafts d1..d(k-1) were fed to the draft model at positions n..n+k-2 last step; each one the
        target accepted, in order, left correct KV behind. At a request's first call, the positions
        before the first one the target ran: those it found in the prefix cache.
        """
        state = self._states[request.request_id]
        if state.committed is None:
            state.committed = request.hidden_start
        tokens = request.token_ids
        reusable = state.committed
        for position, draft in enumerate(state.last_drafts[:-1], start=state.last_length):
            if position >= len(tokens) - 1 or tokens[position] != draft:
                break
            reusable = position + 1
        return min(reusable, len(tokens) - 1)

    def _first_pass(
        self, batch: ProposeBatch, requests: list[ProposalRequest], chunks: list[list[int]], ends: list[int]
    ) -> torch.Tensor:
        """Run the draft over one chunk per request, the chunk ending before position ``ends[i]``;
        returns the draft's hidden states of every chunk token."""
        metadata = AttentionMetadata.build(
            [len(c) for c in chunks], ends, [r.block_table for r in requests], batch.block_size, self.device
        )
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        if self.vocab is not None:
            ids = self.vocab.to_draft(ids)
        return self.model(ids, metadata.positions, batch.kv_caches, metadata)

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        return self.vocab.mask_logits(logits) if self.vocab is not None else logits

    def _pick(self, logits: torch.Tensor, sampling: SamplingBatch | None) -> tuple[torch.Tensor, DraftSample]:
        """(the draft's own ids, fed to the next step; the sample in target ids).

        A draft of another vocabulary drafts greedily through the shared tokens; otherwise core's
        draft sampler drafts greedily or from the draft distribution shaped like the target's (the
        request's temperature, top-k, top-p, min-p and seed), so a draft that equals the target
        proposes from exactly the distribution the target verifies against.
        """
        if self.sampler is None:
            draft_ids = argmax_rows(logits)
            return draft_ids, DraftSample(self.vocab.to_target(draft_ids), None)
        sample = self.sampler.sample(logits, sampling)
        return sample.token_ids, sample
