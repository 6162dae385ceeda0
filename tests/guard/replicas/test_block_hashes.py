"""The guard's block hashes: identical to the kvguard engine's (when the engine is importable)
and chained, so a shared prefix shares exactly its leading hashes."""

import importlib.util

import pytest

from guard.replicas.block_hashes import id_chunk_hashes, text_chunk_hashes, token_block_hashes

TOKENS = list(range(1000, 1100))


def test_a_shared_prefix_shares_exactly_its_leading_blocks():
    a = token_block_hashes(TOKENS, 16, "m")
    b = token_block_hashes(TOKENS[:40] + [7] * 60, 16, "m")
    assert len(a) == 6 and a[:2] == b[:2] and a[2] != b[2]
    assert token_block_hashes(TOKENS, 16, "m", cache_salt="t1")[0] != a[0]
    assert token_block_hashes(TOKENS, 16, "other")[0] != a[0]
    assert token_block_hashes(TOKENS, 16, "m", max_blocks=2) == a[:2]
    with pytest.raises(ValueError):
        token_block_hashes([-1] * 16, 16, "m")


def test_text_and_id_chunks_chain_the_same_way():
    text = "s" * 600
    assert text_chunk_hashes(text + "x", 256, "m")[:2] == text_chunk_hashes(text + "y", 256, "m")
    assert text_chunk_hashes(text, 256, "m", "salt")[0] != text_chunk_hashes(text, 256, "m")[0]
    assert len(id_chunk_hashes(TOKENS, 16, "m")) == 6


@pytest.mark.skipif(importlib.util.find_spec("engine.block_hash") is None,
                    reason="the engine's prefix cache is not on this branch")
def test_identical_to_the_engines_block_hashes():
    from engine.block_hash import prefix_block_hashes

    for salt in (None, "tenant-salt"):
        for size in (1, 16, 7):
            assert list(token_block_hashes(TOKENS, size, "tiny", salt)) == prefix_block_hashes(
                TOKENS, size, "tiny", salt)
