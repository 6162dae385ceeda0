"""Block pool and per-request block tables: exact ids, counts, and all-or-nothing allocation."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, BlockPool


def test_allocate_grows_table_by_whole_blocks_in_fifo_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []  # still fits in two blocks
    assert bm.allocate("b", 1) == [2]
    assert bm.allocate("a", 9) == [3]
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_allocate_returns_none_and_changes_nothing_when_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 4)
    assert bm.allocate("b", 12) is None
    assert bm.block_table("b") == []
    assert bm.num_free_blocks == 2
    assert bm.pool.ref_counts == [1, 0, 0]
    bm.check_invariants()


def test_free_returns_blocks_to_the_back_of_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 2)  # [2]
    assert bm.free("a") == 2
    assert bm.free("a") == 0  # idempotent
    assert bm.allocate("c", 6) == [3, 0, 1]
    assert bm.pool.ref_counts == [1, 1, 1, 1]
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 4 and bm.pool.ref_counts == [0, 0, 0, 0]
    bm.check_invariants()


def test_fork_shares_blocks_until_both_are_freed():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("parent", 3)
    bm.fork("parent", "child")
    assert bm.block_table("child") == [0, 1]
    assert bm.pool.ref_counts == [2, 2, 0, 0]
    bm.free("parent")
    assert bm.num_free_blocks == 2
    bm.free("child")
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_pool_rejects_double_release_and_bad_sizes():
    pool = BlockPool(2)
    [block] = pool.take(1)
    pool.release(block)
    with pytest.raises(ValueError, match="released more often"):
        pool.release(block)
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)


def test_check_invariants_catches_a_corrupted_count():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", 2)
    bm.pool.ref_counts[0] = 2
    with pytest.raises(AssertionError):
        bm.check_invariants()
