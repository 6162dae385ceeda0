"""The block hash a router recomputes from token ids: chained, salted, pinned to version 1."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.block_hash import block_hash, prefix_block_hashes, root_hash


def test_pinned_values_of_version_1():
    # A copy of the algorithm elsewhere (the guard) must reproduce these exact numbers.
    assert root_hash("tiny") == 4978169682035081948
    assert root_hash("tiny", "s") == 17247501106962271433
    assert prefix_block_hashes(list(range(8)), 4, "tiny") == [2022800913290970233,
                                                               496006501542402089]


def test_the_documented_byte_layout():
    def h(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    root = h(b"kvguard-block-hash-v1\0" + b"m" + b"\0" + b"\1" + b"salt")
    assert root_hash("m", "salt") == root
    first = h(root.to_bytes(8, "little") + struct.pack("<3I", 5, 6, 7))
    assert prefix_block_hashes([5, 6, 7, 8], 3, "m", "salt") == [first]
    assert block_hash(root, [5, 6, 7]) == first


def test_a_block_hash_depends_on_every_earlier_token_the_model_and_the_salt():
    base = prefix_block_hashes(list(range(12)), 4, "m")
    assert len(base) == 3 and len(set(base)) == 3
    changed_first = prefix_block_hashes([99] + list(range(1, 12)), 4, "m")
    assert all(a != b for a, b in zip(base, changed_first, strict=True))
    changed_last = prefix_block_hashes(list(range(11)) + [99], 4, "m")
    assert changed_last[:2] == base[:2] and changed_last[2] != base[2]
    assert prefix_block_hashes(list(range(12)), 4, "other")[0] != base[0]
    salted = prefix_block_hashes(list(range(12)), 4, "m", "tenant-a")
    assert salted[0] != base[0]
    assert salted != prefix_block_hashes(list(range(12)), 4, "m", "tenant-b")


def test_only_full_blocks_are_hashed_and_hashes_are_64_bit():
    assert prefix_block_hashes([1, 2, 3], 4, "m") == []
    hashes = prefix_block_hashes(list(range(9)), 4, "m")
    assert len(hashes) == 2 and all(0 <= x < 2**64 for x in hashes)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes([1], 0, "m")
    with pytest.raises(ValueError, match="token ids"):
        block_hash(0, [-1])
