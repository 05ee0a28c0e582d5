"""Fixed-size KV blocks: allocation, growth and freeing of each request's block table."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out physical KV block ids.

    Every layer of the paged cache (the target's and a proposer's own) is indexed by the same block
    ids, so one block table per request covers them all. Blocks are reused LIFO-free (a deque), which
    keeps recently freed, cache-warm blocks in use.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for metrics."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a table needs so that it covers ``num_tokens`` positions."""
        required = -(-num_tokens // self.block_size)
        return max(0, required - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend ``block_table`` in place to cover ``num_tokens``; False (and no change) if out of blocks."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_table.append(self._free.popleft())
        return True

    def free(self, block_table: list[int]) -> None:
        """Return every block of the table and empty it."""
        self._free.extendleft(reversed(block_table))
        block_table.clear()
