"""Attention metadata for draft layers in the shared paged cache.

A draft that keeps its own KV (EAGLE, MTP, DFlash context) writes it under the request's block
table, like the target. Three shapes of draft pass exist:

* the first pass of a step, over each request's new target positions (its prefill chunk, or its
  newest accepted positions): :func:`first_pass_metadata`, built from host lists once per step.
  It rewrites the draft KV from the first position whose target state is new, which is the draft's
  rollback: whatever the previous step's chain left at those positions is overwritten.
* chained single-token steps 2..k (autoregressive drafters): :class:`DraftChain` works out every
  step's positions, slots and lengths on the host once per chain and uploads them together, so a
  step takes views and reads nothing back to the host.
* one non-causal block per request (DFlash, DSpark): :func:`block_metadata`, where every query slot
  of the block sees the whole context and every slot of its block.

Chained steps only ever write positions from the request's newest token on; those are provisional
and the next step's first pass rewrites them. A request whose chain is shorter than the batch's keeps
rewriting its own last provisional position, so it never touches KV another request or its own
committed context relies on.
"""

from __future__ import annotations

import torch

from sonar_core.layers.attention import AttentionMetadata
from sonar_core.spec_decode.proposer import ProposalRequest


def first_pass_metadata(
    requests: list[ProposalRequest], block_size: int, device: torch.device | str | None
) -> AttentionMetadata:
    """Causal metadata over each request's hidden rows (positions ``hidden_start`` onwards)."""
    return AttentionMetadata.build(
        [r.num_hidden_rows for r in requests],
        [r.hidden_start + r.num_hidden_rows for r in requests],
        [r.block_table for r in requests],
        block_size,
        torch.device(device or "cpu"),
    )


def block_metadata(
    starts: list[int],
    block_len: int,
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str | None,
    causal: bool = False,
) -> AttentionMetadata:
    """Metadata of one ``block_len`` query block per request at positions ``starts[i] ..
    starts[i] + block_len - 1``: every slot sees the context and (non-causal, the default) the whole
    block, or (causal) the slots up to its own."""
    return AttentionMetadata.build(
        [block_len] * len(starts),
        [start + block_len for start in starts],
        block_tables,
        block_size,
        torch.device(device or "cpu"),
        causal=causal,
    )


class DraftChain:
    """Metadata for chained draft steps: one token per request, one position further each step.

    ``first_positions[i]`` is where request ``i``'s first chained token sits (its newest token's
    position); ``last_positions[i]`` the furthest it may write (its last draft's input position).
    Positions past that are clamped to it.

    Every step's positions, lengths and cache slots are known from the start, so they are worked
    out on the host once and uploaded in one tensor; a step then only takes views of it. A draft
    pass is a handful of small kernels, and building its metadata with device operations cost as
    much as one of them.
    """

    def __init__(
        self,
        first_positions: list[int],
        last_positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> None:
        if any(last < first for first, last in zip(first_positions, last_positions, strict=True)):
            raise ValueError("a chained request's last position precedes its first")
        for table, last in zip(block_tables, last_positions, strict=True):
            if len(table) * block_size <= last:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold position {last}")
        num_steps = 1 + max(last - first for first, last in zip(first_positions, last_positions, strict=True))
        steps = []  # per step: [positions, seq_lens, slots], one entry per request each
        for step in range(num_steps):
            positions = [min(first + step, last) for first, last in zip(first_positions, last_positions, strict=True)]
            slots = [
                table[position // block_size] * block_size + position % block_size
                for table, position in zip(block_tables, positions, strict=True)
            ]
            steps.append([positions, [position + 1 for position in positions], slots])
        width = max(len(table) for table in block_tables)
        padded = [list(table) + [0] * (width - len(table)) for table in block_tables]
        self.block_size = block_size
        self.block_tables = torch.tensor(padded, dtype=torch.int64).to(device)
        self._steps = torch.tensor(steps, dtype=torch.int64).to(device)  # [steps, 3, B]
        self._max_seq_lens = [max(seq_lens) for _, seq_lens, _ in steps]
        self._query_start_loc = torch.arange(len(first_positions) + 1, dtype=torch.int64).to(device)
        self._step = 0

    @property
    def positions(self) -> torch.Tensor:
        """``[B]`` positions of the current step's tokens."""
        return self._steps[self._step, 0]

    def metadata(self) -> AttentionMetadata:
        """Metadata of the current step."""
        positions, seq_lens, slots = self._steps[self._step].unbind(0)
        max_seq_len = self._max_seq_lens[self._step]
        num_seqs = positions.shape[0]
        return AttentionMetadata(
            query_start_loc=self._query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_tables,
            slot_mapping=slots,
            positions=positions,
            block_size=self.block_size,
            num_seqs=num_seqs,
            max_query_len=1,
            max_seq_len=max_seq_len,
            context_block_ids=self.block_tables[:, : -(-max_seq_len // self.block_size)].reshape(-1),
            query_pad_index=None,
            needs_mask=num_seqs > 1,
        )

    def advance(self) -> None:
        """Move every request one position on (clamped at its last position)."""
        self._step = min(self._step + 1, len(self._max_seq_lens) - 1)
