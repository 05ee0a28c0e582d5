"""KV forks of a request, for draft branches verified beside its own chain.

A branch's tokens sit at the same positions as the request's own drafts, so it needs blocks of its
own from the block holding the request's newest token on; every earlier block is shared. Forking
copies the filled part of that first block (in every layer: the target's and the proposer's), and a
fork that wins verification is copied back over the request's blocks, which is all a rollback or
an adoption takes: the rows after the accepted ones are rewritten by the next step, as for chains.
"""

from __future__ import annotations

import torch

from sonar_core import cpu_kernels
from sonar_core.engine.block_manager import BlockManager
from sonar_core.spec_decode.proposer import KVFork


class KVForker:
    """Makes, adopts and frees the KV forks of requests in the engine's paged cache."""

    def __init__(self, block_manager: BlockManager, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.block_manager = block_manager
        # Every layer indexed by the block ids, the target's and the proposer's (empty ones left out).
        self.caches = [cache for pair in caches for cache in pair if cache.numel()]
        on_cpu = bool(self.caches) and all(cache.device.type == "cpu" and cache.is_contiguous() for cache in self.caches)
        self._kernels = cpu_kernels.load() if on_cpu else None

    def fork(self, block_table: list[int], position: int, end: int, count: int) -> list[KVFork]:
        """Up to ``count`` forks of a table whose newest token sits at ``position``, each with own
        blocks covering positions ``position .. end - 1``; fewer when blocks run short."""
        block_size = self.block_manager.block_size
        first = position // block_size
        num_own = -(-end // block_size) - first
        forks: list[KVFork] = []
        for _ in range(count):
            own: list[int] = []
            if not self.block_manager.grow(own, num_own * block_size):
                break
            forks.append(KVFork(block_table[:first] + own, own, first))
        if position % block_size:
            self._copy_blocks([block_table[first]] * len(forks), [fork.own_blocks[0] for fork in forks])
        return forks

    def adopt(self, fork: KVFork, block_table: list[int], end: int) -> None:
        """Copy a fork's own blocks back over ``block_table``, up to position ``end - 1``."""
        last = -(-end // self.block_manager.block_size)
        count = last - fork.first_own
        self._copy_blocks(fork.own_blocks[:count], block_table[fork.first_own : last])

    def free(self, forks: list[KVFork]) -> None:
        for fork in forks:
            self.block_manager.free(fork.own_blocks)

    def _copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole blocks in every layer, in one call: a step forks a block in some sixty caches,
        and a call per cache would cost more than the copies."""
        if len(sources) != len(targets):
            raise ValueError(f"copying {len(sources)} KV blocks onto {len(targets)}")
        if not sources or not self.caches:
            return
        if self._kernels is not None:
            self._kernels.copy_kv_blocks_(self.caches, sources, targets)
            return
        destinations = [cache[target] for cache in self.caches for target in targets]
        origins = [cache[source] for cache in self.caches for source in sources]
        torch._foreach_copy_(destinations, origins)
