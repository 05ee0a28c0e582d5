"""The ``ngram`` (host) and ``ngram_gpu`` (device) proposers and their factories.

Both copy continuations of recurring n-grams out of each request's own tokens; they need no
weights, no hidden states and no KV cache, and their drafts are one-hot. They differ only in where
the search runs: ``ngram`` walks the batch on the host with numpy, ``ngram_gpu`` searches the whole
batch at once on the engine's device so that long batches do not serialise on the CPU.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import torch

from sonar_core.spec_decode.prompt_lookup import LookupBounds, PromptLookup, resolve_lookup_bounds
from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    ProposerContext,
)
from sonar_ngram.lookup_device import DeviceTokenSlots, batch_find_drafts


class NgramProposer(Proposer):
    """Prompt lookup on the host, one vectorised search per request over an incrementally kept buffer."""

    capabilities = ProposerCapabilities(free_drafts=True)

    def __init__(self, bounds: LookupBounds) -> None:
        self.bounds = bounds
        self._lookup = PromptLookup(bounds)

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._lookup.add(request_id, prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        self._lookup.remove(request_id)

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        """Each request's lookup draft, labelled with the matched n-gram's length."""
        drafts = [
            self._lookup.draft(r.request_id, r.token_ids, r.num_new_tokens, r.max_draft_tokens) for r in batch.requests
        ]
        return DraftProposal(
            token_ids=[draft.tokens for draft in drafts], sources=[draft.match_length for draft in drafts]
        )


class NgramGPUProposer(Proposer):
    """Prompt lookup for the whole batch on the device.

    Each request owns a row of a device token tensor that is updated with only the step's new
    tokens. A step makes one host-to-device copy (new tokens, their positions and the per-request
    lengths and limits, packed together) and one device-to-host copy (the drafts); the search runs
    entirely on the device.
    """

    capabilities = ProposerCapabilities(free_drafts=True)

    def __init__(
        self, bounds: LookupBounds, num_speculative_tokens: int, max_model_len: int, device: torch.device
    ):
        self.bounds = bounds
        self.num_speculative_tokens = num_speculative_tokens
        self.device = torch.device(device)
        self._slots = DeviceTokenSlots(self.device, max_len=max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Give the request an empty row (dropping any stale one); the first propose call fills it."""
        self._slots.release(request_id)
        self._slots.slot(request_id)

    def remove_request(self, request_id: str) -> None:
        self._slots.release(request_id)

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        if not batch.requests:
            return DraftProposal(token_ids=[])
        drafts, counts, match_lengths = self.propose_on_device(batch.requests)
        rows = torch.stack([counts, match_lengths], dim=1)
        rows = torch.cat([rows, drafts.to(torch.int64)], dim=1).cpu().tolist()
        return DraftProposal(token_ids=[row[2 : 2 + row[0]] for row in rows], sources=[row[1] for row in rows])

    def propose_on_device(self, requests: list[ProposalRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Update the device rows and search them: ``[B, num_speculative_tokens]`` drafts, ``[B]``
        counts and ``[B]`` matched n-gram lengths."""
        size = len(requests)
        host, num_new, longest = self._pack_updates(requests)
        packed = torch.from_numpy(host).to(self.device)
        slot_index, lengths, limits, flat_index, values = packed.split([size, size, size, num_new, num_new])
        self._slots.write(flat_index, values)
        rows = self._slots.tokens[:, :longest].index_select(0, slot_index)
        return batch_find_drafts(
            rows, lengths, limits, self.bounds.min_n, self.bounds.max_n, self.num_speculative_tokens
        )

    def _pack_updates(self, requests: list[ProposalRequest]) -> tuple[np.ndarray, int, int]:
        """Reserve rows and pack the step's upload into one int64 array.

        Layout: slots ``[B]``, lengths ``[B]``, draft limits ``[B]``, flat positions (row * width +
        column) of the new tokens ``[N]``, the new tokens ``[N]``. Also returns ``N`` and the longest
        length.
        """
        slots, totals, starts, limits = (np.empty(len(requests), dtype=np.int64) for _ in range(4))
        for i, request in enumerate(requests):
            total = len(request.token_ids)
            totals[i] = total
            starts[i] = max(0, min(self._slots.length(request.request_id), total - request.num_new_tokens))
            slots[i] = self._slots.reserve(request.request_id, total)
            limits[i] = min(request.max_draft_tokens, self.num_speculative_tokens)
        # Positions are computed after every reserve(): a row may have widened the tensor.
        width = self._slots.tokens.shape[1]
        counts = totals - starts
        num_new = int(counts.sum())
        first_in_flat = np.cumsum(counts) - counts
        flat_index = np.repeat(slots * width + starts - first_in_flat, counts) + np.arange(num_new)
        values = np.fromiter(
            chain.from_iterable(r.token_ids[s:] for r, s in zip(requests, starts.tolist(), strict=True)),
            dtype=np.int64,
            count=num_new,
        )
        return np.concatenate([slots, totals, limits, flat_index, values]), num_new, int(totals.max())


def _bounds(context: ProposerContext) -> LookupBounds:
    config = context.speculative_config
    return resolve_lookup_bounds(config.prompt_lookup_min, config.prompt_lookup_max)


def create_ngram_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> NgramProposer:
    """Factory of the ``ngram`` method; ``weights`` is unused (prompt lookup has none)."""
    return NgramProposer(_bounds(context))


def create_ngram_gpu_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> NgramGPUProposer:
    """Factory of the ``ngram_gpu`` method; searches on ``context.device``. ``weights`` is unused."""
    return NgramGPUProposer(
        _bounds(context),
        num_speculative_tokens=context.speculative_config.num_speculative_tokens,
        max_model_len=context.max_model_len,
        device=context.device,
    )
