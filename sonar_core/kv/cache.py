"""KV layer specifications and the allocation of their cache tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVLayerSpec:
    """Shape of one attention layer's KV cache (a target layer, or one a proposer owns)."""

    num_kv_heads: int
    head_dim: int


def allocate_kv_cache(
    specs: list[KVLayerSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """One zero-filled ``(k_cache, v_cache)`` pair per spec.

    Zero, not empty: the context read gathers whole blocks, and the unwritten tail of a sequence's
    last block is masked out of the softmax. Masked garbage is harmless unless it is NaN/Inf, which
    uninitialised memory can be (0 * NaN = NaN in the value product).
    """
    caches = []
    for spec in specs:
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        caches.append(
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        )
    return caches
