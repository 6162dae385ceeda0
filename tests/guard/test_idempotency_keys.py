"""Idempotency keys: hashed, expiring, bounded in bytes whatever the keys' length."""

import tracemalloc

import pytest

from guard.request.idempotency_keys import ENTRY_BYTES, IdempotencyKeys


def test_a_repeat_within_the_ttl_is_seen_per_tenant():
    keys = IdempotencyKeys(ttl_s=10.0, max_bytes=1 << 20)
    assert not keys.seen("acme", "k1", 0.0)
    assert keys.seen("acme", "k1", 5.0)
    assert not keys.seen("other", "k1", 5.0)  # tenants do not share keys
    assert not keys.seen("acme", "k1", 16.0)  # expired (last seen at 5)


def test_over_the_byte_cap_the_oldest_are_evicted():
    keys = IdempotencyKeys(ttl_s=1e9, max_bytes=3 * ENTRY_BYTES)
    for i, key in enumerate(("a", "b", "c", "d")):
        assert not keys.seen("t", key, float(i))
    assert len(keys) == 3 and keys.num_bytes == 3 * ENTRY_BYTES
    assert not keys.seen("t", "a", 10.0)  # evicted: the oldest went first
    assert keys.seen("t", "d", 11.0)


def test_long_keys_cost_no_more_than_short_ones():
    """The reported attack: 3,000 keys of 15 KB grew the guard by 40 MB. Now 10,000 of them
    stay inside the cap, measured by tracemalloc."""
    max_bytes = 1 << 20
    keys = IdempotencyKeys(ttl_s=1e9, max_bytes=max_bytes)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            keys.seen("anon", f"{i:08d}" + "x" * 15_000, float(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(keys) == max_bytes // ENTRY_BYTES
    assert grown <= max_bytes, grown


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="ttl_s"):
        IdempotencyKeys(ttl_s=0, max_bytes=1 << 20)
    with pytest.raises(ValueError, match="max_bytes"):
        IdempotencyKeys(ttl_s=1, max_bytes=10)
