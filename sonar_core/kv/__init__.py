"""The paged KV cache's tensors and their shapes: the lowest layer of the engine.

A KV layer is a ``(k_cache, v_cache)`` pair, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Target models and proposers describe the layers they need with :class:`KVLayerSpec`;
the engine allocates them all in one cache that shares each request's block table.
"""

from sonar_core.kv.cache import KVCache, KVLayerSpec, allocate_kv_cache

__all__ = ["KVCache", "KVLayerSpec", "allocate_kv_cache"]
