"""The paged KV cache's tensors and their shapes: the lowest layer of the engine.

A KV layer is a ``(k_cache, v_cache)`` pair, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Target models and proposers describe the layers they need with :class:`KVLayerSpec`;
the engine allocates them all in one cache that shares each request's block table. Recurrent
layers (linear attention) keep a fixed-size state per request instead: :class:`StateLayerSpec`
and :class:`RecurrentStateCache` (see :mod:`sonar_core.kv.state`).
"""

from sonar_core.kv.cache import KVCache, KVLayerSpec, allocate_kv_cache
from sonar_core.kv.state import LayerState, RecurrentStateCache, StateBatch, StateLayerSpec

__all__ = [
    "KVCache",
    "KVLayerSpec",
    "LayerState",
    "RecurrentStateCache",
    "StateBatch",
    "StateLayerSpec",
    "allocate_kv_cache",
]
