"""Fixed-size KV blocks: allocation, growth and freeing of each request's block table, and the
prefix cache of full blocks.

Prefix caching
--------------
A block whose every position holds committed KV (tokens that are part of the request, computed by
the target) is *full*. A full block is identified by its content hash, which chains the parent
block's hash with the block's token ids (:func:`hash_block_tokens`): two requests whose token
prefixes agree up to the end of a block have the same hash for it, and (the model being fixed per
engine) the same KV in it. With ``enable_caching`` the manager keeps a ``hash -> block`` map of
full blocks; a new request takes the cached blocks of its leading full blocks (reference counted)
and computes from the first uncached token on.

A proposer whose KV of a position also depends on the tokens after it (EAGLE pairs the target's
state at ``t`` with token ``t + 1``) declares that reach, ``lookahead``: each block's hash then also
covers the ``lookahead`` tokens that follow it, so two requests share a block only where its
proposer KV is the same for both.

A full, registered block is immutable: its owner only writes at positions past its committed
tokens, i.e. into later blocks, and a request that took it from the cache starts writing after it.
:meth:`BlockManager.check_writable` asserts that no step writes into a registered or shared block
(so no copy-on-write is ever needed).

A block whose reference count drops to zero keeps its hash and stays in the cache as *evictable*;
it still counts in :attr:`BlockManager.num_free_blocks`, since allocation reuses it (least recently
freed first) once no never-hashed block is left, dropping its hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Protocol

from sonar_core.errors import ConfigError

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The content hash of one full block: the parent block's hash (None for the first block) and
    the block's token ids. 128-bit BLAKE2b, so that distinct prefixes never share a hash in
    practice (Python's 64-bit ``hash`` of a tuple is collision-prone by comparison)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, lookahead: int = 0
) -> None:
    """Append to ``hashes`` (the chained hashes of a request's first blocks) those of the blocks
    that follow: ``token_ids`` holds their tokens and the ``lookahead`` tokens after the last of
    them (``(len(token_ids) - lookahead) // block_size`` whole blocks), each block hashed with the
    ``lookahead`` tokens after it."""
    for start in range(0, len(token_ids) - block_size - lookahead + 1, block_size):
        covered = token_ids[start : start + block_size + lookahead]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, covered))


class _Capabilities(Protocol):
    kv_layers: tuple
    target_hidden_layers: tuple[int, ...]
    prefix_cache_lookahead: int | None


def resolve_prefix_caching(
    requested: bool | None, capabilities: _Capabilities | None, has_recurrent_state: bool
) -> bool:
    """Whether the engine caches prefixes: ``enable_prefix_caching`` (None: wherever it is lossless).

    It is lossless when every KV entry of a full block is written once, at the step that computed
    the target's KV there, from the tokens the block's hash covers (the proposer's reach included:
    :attr:`~sonar_core.spec_decode.proposer.ProposerCapabilities.prefix_cache_lookahead`), and
    nothing else is kept per position. Not so, hence off by default and a :class:`ConfigError`
    when asked for:

    - a proposer with KV layers of its own that declares no ``prefix_cache_lookahead`` (a custom
      proposer): its KV shares the block tables, but nothing says it is written in the step that
      fills a block, so a cached block may hold no valid, immutable proposer KV;
    - a proposer that reads the target's per-position states (``target_hidden_layers``) and
      declares no ``prefix_cache_lookahead`` (the hidden-state exporter): a cached prefix is never
      run, so its states would be missing;
    - a target with recurrent-state layers (hybrid linear attention): the state after a prefix is
      not kept per block, so a request could not start after its cached blocks.
    """
    reasons = []
    shares_cached_blocks = capabilities is not None and capabilities.prefix_cache_lookahead is not None
    if capabilities is not None and capabilities.kv_layers and not shares_cached_blocks:
        reasons.append("the speculative method keeps KV layers of its own in the paged cache and does not declare "
                       "prefix_cache_lookahead (that it writes them in the step that fills each block), so a cached "
                       "block might not hold them")
    if capabilities is not None and capabilities.target_hidden_layers and not shares_cached_blocks:
        reasons.append("the speculative method reads the target's states at every position, which a cached "
                       "prefix does not compute")
    if has_recurrent_state:
        reasons.append("the model has linear-attention layers, whose recurrent state is not cached per block")
    if not reasons:
        return requested is not False
    if requested:
        raise ConfigError(
            "enable_prefix_caching",
            "prefix caching would not be lossless here: " + "; and ".join(reasons),
            "leave out --enable-prefix-caching (enable_prefix_caching unset or False in Python): prefix caching "
            "is then off for this configuration",
        )
    return False


class BlockManager:
    """Hands out physical KV block ids, with reference counts, and caches full blocks by content.

    Every layer of the paged cache (the target's and a proposer's own) is indexed by the same block
    ids, so one block table per request covers them all. Blocks without cached content are reused
    LIFO (a deque), which keeps recently freed, cache-warm blocks in use; cached blocks that no
    request holds are evicted least recently freed first, and only when no other block is free.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, lookahead: int = 0) -> None:
        if num_blocks < 1 or block_size < 1 or lookahead < 0:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive, lookahead ({lookahead}) "
                "not negative"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Tokens after a block that its hash covers too (the proposer's reach; see the module docstring).
        self.lookahead = lookahead
        # Blocks nobody holds and that cache nothing.
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        # Blocks nobody holds that keep their cached content; first in, first evicted.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may use now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held by requests or evictable)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (held by a request), for metrics."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a table needs so that it covers ``num_tokens`` positions."""
        required = -(-num_tokens // self.block_size)
        return max(0, required - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend ``block_table`` in place to cover ``num_tokens``; False (and no change) if out of blocks."""
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_table.append(self._allocate())
        return True

    def free(self, block_table: list[int]) -> None:
        """Drop the table's reference to each of its blocks and empty it.

        Blocks nobody holds any more go back to the pool; cached ones stay cached as evictable, the
        table's last blocks (the least likely to be shared) first in line for eviction.
        """
        for block in reversed(block_table):
            if self._refs[block] <= 0:
                raise AssertionError(f"KV block {block} freed while no request holds it (double free)")
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.appendleft(block)
        block_table.clear()

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.num_evictions += 1
        self._refs[block] = 1
        return block

    # ---------------------------------------------------------------------------- prefix cache
    def cached_blocks(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` (a request's leading full blocks, in
        order) that the cache holds; nothing is taken yet."""
        blocks: list[int] = []
        if not self.enable_caching:
            return blocks
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_take(self, cached: list[int], block_table: list[int], num_tokens: int) -> bool:
        """Whether a table that takes ``cached`` (see :meth:`take`) can then grow to ``num_tokens``:
        taking an evictable block removes it from the free pool."""
        needed = self.blocks_needed(block_table, num_tokens) - len(cached)
        revived = sum(1 for block in cached if self._refs[block] == 0)
        return max(needed, 0) <= self.num_free_blocks - revived

    def take(self, block_table: list[int], cached: list[int]) -> None:
        """Append cached blocks (from :meth:`cached_blocks`) to ``block_table``, referencing each."""
        for block in cached:
            if block not in self._hash_of:
                raise AssertionError(f"KV block {block} is not cached")
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            block_table.append(block)

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Cache a full block under its content hash. The block must be held and its KV complete; it
        is never written again. A hash another block already caches keeps that block (this one
        then stays uncached and returns to the plain pool when freed)."""
        if not self.enable_caching:
            return
        if self._refs[block] <= 0:
            raise AssertionError(f"KV block {block} registered while no request holds it")
        known = self._hash_of.get(block)
        if known is not None:
            if known != block_hash:
                raise AssertionError(f"KV block {block} is cached under another hash")
            return
        if block_hash in self._block_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash

    def check_writable(self, block_table: list[int], start: int, end: int) -> None:
        """Assert that positions ``start..end-1`` of a table lie in blocks that only this table holds
        and that the cache does not hold (full blocks are immutable; nothing is copied on write)."""
        if end <= start:
            return
        for index in range(start // self.block_size, min(-(-end // self.block_size), len(block_table))):
            block = block_table[index]
            if self._refs[block] != 1 or block in self._hash_of:
                raise AssertionError(
                    f"a step would write positions {start}..{end - 1} into KV block {block} (table index {index}), "
                    f"which is {'cached' if block in self._hash_of else 'shared'} (ref count {self._refs[block]})"
                )

    def check_accounting(self, block_tables: Iterable[list[int]] = ()) -> None:
        """Raise AssertionError unless the books balance: every block is exactly one of free,
        evictable (cached, ref count 0) or held, and the reference counts are exactly the number of
        times ``block_tables`` (every live request's table; none once all requests finished) list
        each block."""
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                expected[block] += 1
        problems: list[str] = []
        if expected != self._refs:
            wrong = [(b, self._refs[b], expected[b]) for b in range(self.num_blocks) if self._refs[b] != expected[b]]
            problems.append(f"reference counts (block, counted, held by tables): {wrong[:8]}")
        free = set(self._free)
        evictable = set(self._evictable)
        if len(free) != len(self._free):
            problems.append("a block is twice in the free pool")
        if free & evictable:
            problems.append(f"blocks both free and evictable: {sorted(free & evictable)[:8]}")
        held = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        if (free | evictable) & held:
            problems.append(f"held blocks in the free pool: {sorted((free | evictable) & held)[:8]}")
        lost = set(range(self.num_blocks)) - free - evictable - held
        if lost:
            problems.append(f"blocks neither free, evictable nor held (leaked): {sorted(lost)[:8]}")
        if any(b in self._hash_of for b in free):
            problems.append("a free block keeps a cached hash")
        if any(b not in self._hash_of for b in evictable):
            problems.append("an evictable block has no cached hash")
        if {self._block_of.get(h) for h in self._hash_of.values()} != set(self._hash_of) or len(
            self._block_of
        ) != len(self._hash_of):
            problems.append("the hash -> block and block -> hash maps disagree")
        if not self.enable_caching and self._hash_of:
            problems.append("blocks are cached although caching is off")
        if problems:
            raise AssertionError("KV block accounting is off: " + "; ".join(problems))
