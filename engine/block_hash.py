"""The identity of a full KV block: a 64-bit hash chained over the prompt's blocks.

Stdlib only and free of engine types, so that a router (the guard's precise prefix view) can
recompute exactly what a kvguard engine publishes in its KV-cache events from token ids alone.

The algorithm (version 1), all integers unsigned 64-bit, ``H(b)`` = BLAKE2b of the bytes ``b``
with an 8-byte digest read little-endian:

* the root of a request is ``H(b"kvguard-block-hash-v1\\0" + model + b"\\0" + salt_part)`` where
  ``model`` is the served model name in UTF-8 and ``salt_part`` is ``b"\\0"`` without a
  ``cache_salt`` and ``b"\\1" + salt`` (UTF-8) with one;
* block ``i`` (tokens ``[i * block_size, (i + 1) * block_size)``, full blocks only) hashes to
  ``H(parent.to_bytes(8, "little") + tokens as little-endian uint32)``, its parent being block
  ``i - 1``'s hash, or the root for block 0.

So two prompts share a block's hash exactly when they share the model, the salt and every token
up to the end of that block. In KV events the first block's ``parent_block_hash`` is None (the
root is not a block); every hash is an int in ``[0, 2**64)``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["HASH_VERSION", "block_hash", "prefix_block_hashes", "root_hash"]

HASH_VERSION = 1
_ROOT_TAG = b"kvguard-block-hash-v1\0"
_MAX_TOKEN_ID = (1 << 32) - 1


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_hash(model: str, cache_salt: str | None = None) -> int:
    """The parent of a request's first block: binds its chain to the model and the salt."""
    salt_part = b"\0" if cache_salt is None else b"\1" + cache_salt.encode()
    return _h(_ROOT_TAG + model.encode() + b"\0" + salt_part)


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The hash of one full block given its parent's hash (or the root for block 0)."""
    if any(not 0 <= t <= _MAX_TOKEN_ID for t in token_ids):
        raise ValueError("token ids must be in [0, 2**32)")
    return _h(parent_hash.to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}I", *token_ids))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, model: str,
                        cache_salt: str | None = None) -> list[int]:
    """The chained hashes of every full block of ``token_ids`` (a trailing partial block has
    none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = root_hash(model, cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
