"""The ``suffix`` proposer: drafts from a suffix tree of each request's prompt and of earlier responses.

arctic-inference's :class:`SuffixDecodingCache` holds two kinds of tree. A *prompt tree* per active
request holds its prompt and its output so far; one *response tree* shared by all requests holds
the outputs of the last ``suffix_decoding_max_cached_requests`` requests, so a request that repeats
what an earlier one answered (an agent's tool calls, a fixed JSON shape) is drafted from it. Each
step the latest tokens are matched against both trees and the likelier continuation is drafted; its
length follows the match (``max_spec_factor``) and the continuation's frequency
(``min_token_prob``), never more than the step's ``max_draft_tokens``.

Request lifecycle:

- ``add_request`` (start, or resume after a preemption) opens the prompt tree and a fresh entry in
  the response tree; a resumed request's output so far is added on its first ``propose``. An
  entry left under the same id is evicted first, so no output is counted twice.
- ``propose`` feeds the tokens accepted since the previous call to both trees, then drafts.
- ``finish_request`` (the request ended with a complete output) adds the tokens of its last step,
  which no ``propose`` saw, so the cached response holds its ending too.
- ``remove_request`` (the request finished) drops the prompt tree and keeps the response in the
  shared tree for later requests, as vLLM does.
- ``discard_request`` (aborted or preempted: the output is incomplete) drops the prompt tree and
  evicts the partial response, so no later request drafts from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from arctic_inference.suffix_decoding import SuffixDecodingCache

from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    ProposerContext,
)
from sonar_suffix.options import SuffixOptions


class SuffixProposer(Proposer):
    """Suffix decoding over prompt trees and a shared response tree; one-hot chain drafts."""

    # No weights, no hidden states, no KV: the trees live on the host, and a draft costs a walk of
    # them, so with depth_policy "auto" the engine cuts whole drafts by their match length.
    capabilities = ProposerCapabilities(free_drafts=True)

    def __init__(self, options: SuffixOptions) -> None:
        self.options = options
        self.cache = SuffixDecodingCache(
            max_tree_depth=options.suffix_decoding_max_tree_depth,
            max_cached_requests=options.suffix_decoding_max_cached_requests,
        )
        # request id -> how many of its tokens (prompt + output) the trees hold.
        self._num_fed: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Open the request's prompt tree; a resumed request's output so far follows on its first propose."""
        if request_id in self._num_fed:
            self.cache.stop_request(request_id)
        # start_request evicts a response cached under the same id before it allocates the new one.
        self.cache.start_request(request_id, _int32(prompt_token_ids))
        self._num_fed[request_id] = len(prompt_token_ids)

    def finish_request(self, request_id: str, token_ids: list[int]) -> None:
        """Add the output tokens no ``propose`` saw (the last step's) to the trees."""
        self._feed_tokens(request_id, token_ids)

    def remove_request(self, request_id: str) -> None:
        """Close the prompt tree; the response stays in the shared tree until the oldest-first eviction."""
        if self._num_fed.pop(request_id, None) is not None:
            self.cache.stop_request(request_id)

    def discard_request(self, request_id: str) -> None:
        """Close the prompt tree and evict the incomplete response from the shared tree."""
        self.remove_request(request_id)
        if request_id in self.cache.cached_requests:
            self.cache.evict_cached_response(request_id)

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        """Each request's draft, labelled with the length of the match it continues."""
        drafts = [self._draft(request) for request in batch.requests]
        return DraftProposal(token_ids=[tokens for tokens, _ in drafts], sources=[length for _, length in drafts])

    def _draft(self, request: ProposalRequest) -> tuple[list[int], int]:
        """The request's draft and its match length (0: no draft)."""
        self._feed(request)
        if request.max_draft_tokens <= 0:
            return [], 0
        # Only the latest max_tree_depth tokens can match: the trees hold nothing longer.
        context = request.token_ids[-self.options.suffix_decoding_max_tree_depth :]
        draft = self.cache.speculate(
            request.request_id,
            _int32(context),
            max_spec_tokens=request.max_draft_tokens,
            max_spec_factor=self.options.suffix_decoding_max_spec_factor,
            min_token_prob=self.options.suffix_decoding_min_token_prob,
            use_tree_spec=False,
        )
        tokens = list(draft.token_ids)
        return tokens, draft.match_len if tokens else 0

    def _feed(self, request: ProposalRequest) -> None:
        """Append the request's tokens that the trees do not hold yet.

        The count of held tokens is kept here rather than taken from ``num_new_tokens``: on a
        request's first call (and after a preemption) that counts the prompt too, which
        ``add_request`` already put in the prompt tree and which must not enter the response tree.
        """
        if request.request_id not in self._num_fed:
            # Never announced through add_request: everything it holds serves its own drafts as a
            # prompt, and nothing of unknown origin enters the shared response tree.
            self.add_request(request.request_id, request.token_ids)
            return
        self._feed_tokens(request.request_id, request.token_ids)

    def _feed_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Put ``token_ids`` past the count already held into the request's response (a request
        not open here gets nothing)."""
        fed = self._num_fed.get(request_id)
        if fed is not None and len(token_ids) > fed:
            self.cache.add_active_response(request_id, _int32(token_ids[fed:]))
            self._num_fed[request_id] = len(token_ids)


def _int32(token_ids: Sequence[int]) -> np.ndarray:
    """The zero-copy input form of the suffix tree: a contiguous int32 array."""
    return np.asarray(token_ids, dtype=np.int32)


def create_suffix_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> SuffixProposer:
    """Factory of the ``suffix`` method; ``weights`` is unused (suffix decoding has none)."""
    options = context.method_options if isinstance(context.method_options, SuffixOptions) else SuffixOptions()
    return SuffixProposer(options)
