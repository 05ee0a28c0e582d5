"""KV layer specifications and the allocation of their cache tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVLayerSpec:
    """Shape of one attention layer's KV cache (a target layer, or one a proposer owns).

    ``value_head_dim`` is the width of a value head when it differs from the key's (``None``: the
    same as ``head_dim``). Multi-head latent attention stores everything it needs in the key cache
    and sets it to 0, so its value cache takes no memory.
    """

    num_kv_heads: int
    head_dim: int
    value_head_dim: int | None = None

    @property
    def value_dim(self) -> int:
        """The width of a value head."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def elements_per_token(self) -> int:
        """Key plus value elements one token occupies in this layer."""
        return self.num_kv_heads * (self.head_dim + self.value_dim)


def allocate_kv_cache(
    specs: list[KVLayerSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """One zero-filled ``(k_cache, v_cache)`` pair per spec: ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` for keys and the same with ``value_dim`` for values.

    Zero, not empty: the context read gathers whole blocks, and the unwritten tail of a sequence's
    last block is masked out of the softmax. Masked garbage is harmless unless it is NaN/Inf, which
    uninitialised memory can be (0 * NaN = NaN in the value product).
    """
    caches = []
    for spec in specs:
        shape = (num_blocks, block_size, spec.num_kv_heads)
        caches.append(
            (
                zeros((*shape, spec.head_dim), dtype, device),
                zeros((*shape, spec.value_dim), dtype, device),
            )
        )
    return caches


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor whose CPU memory is zeroed lazily.

    ``torch.zeros`` writes every byte up front: for the default 2 GiB CPU cache that is seconds of
    page faults before the engine is ready, for memory most runs never touch. numpy's ``zeros``
    asks the allocator for zeroed memory (``calloc``), which the kernel hands out as zero pages
    that become real on first write. The bytes are the same (+0.0 is all-zero bits in every float
    format), the tensor owns the array's memory, and CUDA keeps ``torch.zeros``.
    """
    if torch.device(device).type != "cpu" or 0 in shape:  # (MLA's value caches are empty)
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(shape + (element,), dtype=np.uint8))
    return raw.view(dtype).view(shape)
