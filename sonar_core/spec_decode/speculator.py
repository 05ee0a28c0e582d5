"""Drives a proposer inside the engine: draft budgets, KV reservation, request lifecycle."""

from __future__ import annotations

import torch

from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.sequence import Sequence
from sonar_core.spec_decode.depth import AdaptiveDepth
from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, Proposer


class Speculator:
    """Asks the proposer for the next step's drafts and keeps it in step with each request.

    The engine calls :meth:`propose` after every step with the requests that sampled, and
    :meth:`release` when a request finishes, is aborted or preempted. Nothing here depends on which
    method the proposer implements; only its declared capabilities are read.
    """

    def __init__(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        draft_max_model_len: int,
        block_manager: BlockManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        adaptive_depth: bool = False,
    ) -> None:
        self.proposer = proposer
        self.capabilities = proposer.capabilities
        max_depth = self.capabilities.max_depth
        self.num_speculative_tokens = (
            num_speculative_tokens if max_depth is None else min(num_speculative_tokens, max_depth)
        )
        self.draft_max_model_len = draft_max_model_len
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        self.device = device
        self.depth = AdaptiveDepth(self.num_speculative_tokens) if adaptive_depth else None
        self._known: set[str] = set()

    def draft_budget(self, seq: Sequence, max_model_len: int) -> int:
        """How many drafts a request may get this step.

        Never more than the configured depth; never past the target's or the draft's context limit
        (long requests stop speculating); never more than the tokens the request may still emit
        minus the bonus token, so no work is drafted that max_tokens would throw away.
        """
        budget = self.num_speculative_tokens
        budget = min(budget, max_model_len - seq.num_tokens - 1, self.draft_max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            budget = min(budget, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(budget, 0)

    def propose(
        self,
        seqs: list[Sequence],
        budgets: list[int],
        captured: dict[int, torch.Tensor],
        hidden_rows: list[slice],
    ) -> None:
        """Set ``draft_token_ids`` (and ``draft_probs``) on every request for the next step."""
        if self.depth is not None:
            budgets = self.depth.choose([s.request_id for s in seqs], budgets)
        requests: list[ProposalRequest] = []
        rows: list[torch.Tensor] = []
        num_rows = 0
        extra = self.capabilities.extra_slots_per_request
        for seq, budget, span in zip(seqs, budgets, hidden_rows, strict=True):
            if seq.request_id not in self._known:
                self.proposer.add_request(seq.request_id, seq.prompt_token_ids)
                self._known.add(seq.request_id)
                seq.num_unproposed_tokens = seq.num_tokens
            if budget and not self.block_manager.grow(seq.block_table, seq.num_tokens + budget + extra):
                budget = 0
            length = span.stop - span.start
            requests.append(
                ProposalRequest(
                    request_id=seq.request_id,
                    token_ids=seq.all_token_ids,
                    num_new_tokens=seq.num_unproposed_tokens,
                    max_draft_tokens=budget,
                    block_table=seq.block_table,
                    hidden_rows=slice(num_rows, num_rows + length),
                    params=seq.params,
                    generator=seq.generator,
                )
            )
            seq.num_unproposed_tokens = 0
            num_rows += length
            if captured:
                rows.append(torch.arange(span.start, span.stop, device=self.device))
        target_hidden: dict[int, torch.Tensor] = {}
        if captured and rows:
            index = torch.cat(rows)
            target_hidden = {layer: h.index_select(0, index) for layer, h in captured.items()}
        proposal = self.proposer.propose(
            ProposeBatch(
                requests=requests,
                block_size=self.block_manager.block_size,
                kv_caches=self.kv_caches,
                target_hidden=target_hidden,
                device=self.device,
            )
        )
        offset = 0
        for seq, request, tokens in zip(seqs, requests, proposal.token_ids, strict=True):
            if len(tokens) > request.max_draft_tokens:
                raise RuntimeError(
                    f"proposer {type(self.proposer).__name__} returned {len(tokens)} drafts for request "
                    f"{seq.request_id}, more than its max_draft_tokens={request.max_draft_tokens}"
                )
            seq.draft_token_ids = list(tokens)
            if proposal.probs is not None:
                seq.draft_probs = proposal.probs[offset : offset + len(tokens)]
            offset += len(tokens)

    def observe_verification(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if self.depth is not None:
            self.depth.observe_verification(seq.request_id, num_drafted, num_accepted)

    def observe_step(self, num_target_tokens: int, num_drafted: int, seconds: float) -> None:
        if self.depth is not None:
            self.depth.observe_step(num_target_tokens, num_drafted, seconds)

    def release(self, seq: Sequence) -> None:
        """Forget a request that finished, was aborted or preempted.

        Only a request that ended normally (stop or length) counts as complete output; aborted and
        preempted ones are discarded, so that proposers learning across requests keep nothing of them.
        """
        if self.depth is not None:
            self.depth.forget(seq.request_id)
        if seq.request_id not in self._known:
            return
        self._known.discard(seq.request_id)
        if seq.finish_reason in ("stop", "length"):
            self.proposer.finish_request(seq.request_id, seq.all_token_ids)
            self.proposer.remove_request(seq.request_id)
        else:
            self.proposer.discard_request(seq.request_id)
