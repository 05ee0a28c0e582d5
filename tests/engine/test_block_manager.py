import pytest

from sonar_core.engine.block_manager import BlockManager


def test_grow_allocates_exactly_the_blocks_needed():
    manager = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    assert manager.grow(table, 1)
    assert len(table) == 1
    assert manager.grow(table, 4)
    assert len(table) == 1
    assert manager.grow(table, 9)
    assert len(table) == 3
    assert manager.num_free_blocks == 5
    assert len(set(table)) == 3


def test_grow_fails_without_partial_allocation():
    manager = BlockManager(num_blocks=2, block_size=4)
    table: list[int] = []
    assert not manager.grow(table, 12)
    assert table == []
    assert manager.num_free_blocks == 2


def test_free_returns_every_block():
    manager = BlockManager(num_blocks=4, block_size=2)
    a: list[int] = []
    b: list[int] = []
    manager.grow(a, 3)
    manager.grow(b, 4)
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0
    manager.free(a)
    manager.free(b)
    assert a == [] and b == []
    assert manager.num_free_blocks == 4
    assert manager.usage == 0.0


def test_rejects_empty_cache():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)
