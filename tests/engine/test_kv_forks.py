"""KV forks: a fork shares a request's earlier blocks, holds a copy of the block its newest token is
in (every layer), and a winning fork's blocks are copied back; with the CPU kernel and without."""

from __future__ import annotations

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.kv_forks import KVForker

BLOCK = 4


def _caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three layers (one with an empty value cache, as MLA's), every slot holding its own values."""
    shape = (num_blocks, BLOCK, 2, 8)
    pairs = []
    for layer in range(3):
        keys = torch.arange(num_blocks * BLOCK * 16, dtype=torch.float32).reshape(shape) + 1000 * layer
        values = -keys if layer < 2 else torch.empty(0)
        pairs.append((keys, values))
    return pairs


@pytest.fixture(params=["kernel", "torch"])
def forker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> KVForker:
    if request.param == "kernel" and cpu_kernels.load() is None:
        pytest.skip("the CPU kernels are not built here")
    manager = BlockManager(num_blocks=12, block_size=BLOCK)
    made = KVForker(manager, _caches(12))
    if request.param == "torch":
        monkeypatch.setattr(made, "_kernels", None)
    return made


def test_a_fork_shares_earlier_blocks_and_copies_the_newest_tokens_block(forker):
    manager = forker.block_manager
    table: list[int] = []
    assert manager.grow(table, 3 * BLOCK)
    keys = forker.caches[0]
    before = keys[table[1]].clone()
    # The newest token at position 6 (block 1, offset 2); drafts up to position 9.
    forks = forker.fork(table, position=6, end=10, count=2)
    assert len(forks) == 2
    for fork in forks:
        assert fork.block_table[:1] == table[:1] and fork.first_own == 1
        assert len(fork.own_blocks) == 2 and not set(fork.own_blocks) & set(table)
        for cache in forker.caches:
            assert torch.equal(cache[fork.own_blocks[0]], cache[table[1]])
    assert torch.equal(keys[table[1]], before)
    # Each fork writes its own positions 6..9; the request's blocks keep theirs.
    keys[forks[1].own_blocks[0], 2:].fill_(7.0)
    keys[forks[1].own_blocks[1]].fill_(8.0)
    forker.adopt(forks[1], table, end=9)
    assert torch.all(keys[table[1], 2:] == 7.0) and torch.all(keys[table[2]] == 8.0)
    forker.free(forks)
    manager.check_accounting([table])


def test_a_fork_at_a_block_boundary_copies_nothing(forker):
    table: list[int] = []
    assert forker.block_manager.grow(table, 2 * BLOCK)
    fresh = forker.caches[1][0].clone()
    (fork,) = forker.fork(table, position=BLOCK, end=BLOCK + 3, count=1)
    assert fork.block_table == table[:1] + fork.own_blocks and len(fork.own_blocks) == 1
    assert torch.equal(forker.caches[1][0], fresh)
    forker.free([fork])
    forker.block_manager.check_accounting([table])


def test_forks_stop_where_the_blocks_run_out(forker):
    manager = forker.block_manager
    table: list[int] = []
    assert manager.grow(table, 9 * BLOCK)  # three blocks left, two per fork
    forks = forker.fork(table, position=33, end=37, count=3)  # positions 33..36: blocks 8 and 9
    assert len(forks) == 1
    forker.free(forks)
    manager.check_accounting([table])
