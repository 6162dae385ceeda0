"""PrefixIndex: per-replica LRU sets of chained hashes, bounded by capacity."""

import pytest

from guard.replicas.prefix_index import PrefixIndex


def test_a_match_is_the_run_of_leading_hashes_held():
    index = PrefixIndex(100)
    index.insert("a", [1, 2, 3])
    assert index.num_matched("a", [1, 2, 3, 4]) == 3
    assert index.num_matched("a", [1, 9, 3]) == 1  # a chain: past a miss nothing counts
    assert index.num_matched("a", [9, 1]) == 0
    assert index.num_matched("b", [1, 2]) == 0
    assert index.replica_ids() == ("a",)


def test_capacity_evicts_the_least_recently_used():
    index = PrefixIndex(100)
    index.set_capacity("a", 3)
    index.insert("a", [1, 2, 3])
    index.insert("a", [1])  # touched: now the most recent
    index.insert("a", [4])
    assert index.num_blocks("a") == 3
    assert index.num_matched("a", [1]) == 1 and index.num_matched("a", [2]) == 0
    index.set_capacity("a", 1)  # shrinking evicts at once
    assert index.num_blocks("a") == 1 and index.num_matched("a", [4]) == 1


def test_the_bound_caps_any_capacity_and_remove_and_clear_forget():
    index = PrefixIndex(2)
    index.set_capacity("a", 1000)
    assert index.capacity("a") == 2
    index.insert("a", [1, 2, 3])
    assert index.num_blocks("a") == 2
    index.remove("a", [3, 99])
    assert index.num_blocks("a") == 1
    index.clear("a")
    assert index.num_blocks("a") == 0 and index.replica_ids() == ()


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_blocks_per_replica"):
        PrefixIndex(0)
