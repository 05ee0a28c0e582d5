"""Attention metadata that lets a draft head train through its own forward over the paged cache.

The heads attend through :class:`~sonar_core.layers.attention.PagedAttention`, which reads each
sequence's context through a block table. With blocks of one slot a table can put any slot at any
position, so one cache holds what training needs side by side:

* the *context* of every training sequence, written once (EAGLE's first pass, DFlash's fused
  target states), at slots ``base .. base + n - 1``;
* per query row, *private* slots that follow a prefix of that context: the chained steps of one
  EAGLE row (training-time test), or one DFlash block.

:func:`rows_over_context` builds the metadata of such rows; the cache write and the gradient go
through the ordinary forward, so training runs exactly the code that drafts.
"""

from __future__ import annotations

import torch

from sonar_core.kv import KVLayerSpec, allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata

BLOCK_SIZE = 1


def new_cache(specs: tuple[KVLayerSpec, ...], num_slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A zeroed float32 cache of ``num_slots`` one-slot blocks per layer."""
    return allocate_kv_cache(list(specs), num_slots, BLOCK_SIZE, torch.float32, "cpu")


def prefill(lengths: list[int], bases: list[int]) -> AttentionMetadata:
    """Causal metadata of whole sequences: sequence ``i`` at positions ``0 .. lengths[i] - 1``,
    written to slots ``bases[i] + position``."""
    tables = [list(range(base, base + n)) for base, n in zip(bases, lengths, strict=True)]
    return AttentionMetadata.build(lengths, lengths, tables, BLOCK_SIZE, torch.device("cpu"))


def rows_over_context(
    context_base: torch.Tensor,
    context_len: torch.Tensor,
    private: torch.Tensor,
    query_len: int,
    causal: bool = True,
) -> AttentionMetadata:
    """One sequence per row ``r``: context slots ``context_base[r] + 0 .. context_len[r] - 1`` at
    positions ``0 .. context_len[r] - 1``, then the slots ``private[r]`` (``[R, m]``) at the next
    ``m`` positions. The queries are the last ``query_len`` of those positions and write to the last
    ``query_len`` private slots; ``causal=False`` lets them see each other (a block)."""
    rows, width_private = private.shape
    seq_lens = context_len + width_private
    width = int(seq_lens.max())
    column = torch.arange(width)[None, :]
    offset = column - context_len[:, None]
    tables = torch.where(
        offset < 0,
        context_base[:, None] + column,
        torch.where(offset < width_private, private.gather(1, offset.clamp(0, width_private - 1)), 0),
    )
    positions = (seq_lens - query_len)[:, None] + torch.arange(query_len)[None, :]
    return AttentionMetadata(
        query_start_loc=torch.arange(rows + 1) * query_len,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=private[:, width_private - query_len :].reshape(-1),
        positions=positions.reshape(-1),
        block_size=BLOCK_SIZE,
        causal=causal,
    )
