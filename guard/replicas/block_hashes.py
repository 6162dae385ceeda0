"""Chained block hashes: the keys the guard's prefix-cache view tracks.

Two kinds, one chain rule (each hash covers its block and, through its parent, everything
before it):

* :func:`token_block_hashes` — the kvguard engine's block identity (version 1), recomputed from
  token ids so the precise view can match what the engine publishes in its KV-cache events.
  It must stay identical to the engine's ``engine.block_hash.prefix_block_hashes`` (a test holds
  them to it); the guard never imports the engine. The algorithm: ``H(b)`` is BLAKE2b of ``b``
  with an 8-byte digest read little-endian; the root is
  ``H(b"kvguard-block-hash-v1\\0" + model + b"\\0" + salt_part)`` (``salt_part`` ``b"\\0"``
  without a ``cache_salt``, ``b"\\1" + salt`` with one); block ``i`` is
  ``H(parent.to_bytes(8, "little") + its token ids as little-endian uint32)``.
* :func:`text_chunk_hashes` — the approximate view's: a chain over fixed-size chunks of the
  rendered prompt text (no tokenizer needed), rooted in the model and the salt too, so tenants
  isolated by salt never share an approximate block either. Process-local keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["chained_block_hashes", "id_chunk_hashes", "root_hash", "text_chunk_hashes", "token_block_hashes"]

_ROOT_TAG = b"kvguard-block-hash-v1\0"
_TEXT_TAG = b"kvguard-text-chunk-v1\0"
_MAX_TOKEN_ID = (1 << 32) - 1


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _salt_part(cache_salt: str | None) -> bytes:
    return b"\0" if cache_salt is None else b"\1" + cache_salt.encode()


def root_hash(model: str, cache_salt: str | None = None) -> int:
    """The parent of a request's first token block (the engine's root)."""
    return _h(_ROOT_TAG + model.encode() + b"\0" + _salt_part(cache_salt))


def token_block_hashes(token_ids: Sequence[int], block_size: int, model: str,
                       cache_salt: str | None = None, max_blocks: int | None = None
                       ) -> tuple[int, ...]:
    """The engine's hashes of every full block of ``token_ids`` (at most ``max_blocks``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    return chained_block_hashes(root_hash(model, cache_salt), token_ids[:num_blocks * block_size],
                                block_size)


def chained_block_hashes(parent: int, token_ids: Sequence[int], block_size: int
                         ) -> tuple[int, ...]:
    """The engine's hashes of the full blocks of ``token_ids`` chained from ``parent`` (a root,
    or the hash of the block before them): how the precise view translates another engine's
    stored blocks into kvguard's chain (:mod:`guard.replicas.kv_event_translation`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = []
    fmt = f"<{block_size}I"
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = token_ids[start:start + block_size]
        if any(not 0 <= t <= _MAX_TOKEN_ID for t in block):
            raise ValueError("token ids must be in [0, 2**32)")
        parent = _h(parent.to_bytes(8, "little") + struct.pack(fmt, *block))
        hashes.append(parent)
    return tuple(hashes)


def text_chunk_hashes(text: str, chunk_chars: int, model: str, cache_salt: str | None = None,
                      max_chunks: int | None = None) -> tuple[int, ...]:
    """Chained hashes of every full ``chunk_chars``-character chunk of ``text``.

    Python's own ``hash`` (SipHash, seeded per process): these keys never leave the guard
    process that made them, and it is several times cheaper than BLAKE2b on the request path
    (``docs/benchmarks.md``)."""
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    num_chunks = len(text) // chunk_chars
    if max_chunks is not None:
        num_chunks = min(num_chunks, max_chunks)
    parent = hash((_TEXT_TAG, model, cache_salt))
    hashes = []
    for start in range(0, num_chunks * chunk_chars, chunk_chars):
        parent = hash((parent, text[start:start + chunk_chars]))
        hashes.append(parent)
    return tuple(hashes)


def id_chunk_hashes(token_ids: list[int], chunk_ids: int, model: str,
                    cache_salt: str | None = None) -> tuple[int, ...]:
    """:func:`text_chunk_hashes` for a token-id prompt: chunks of ``chunk_ids`` ids."""
    parent = hash((_TEXT_TAG, model, cache_salt))
    hashes = []
    for start in range(0, len(token_ids) // chunk_ids * chunk_ids, chunk_ids):
        parent = hash((parent, tuple(token_ids[start:start + chunk_ids])))
        hashes.append(parent)
    return tuple(hashes)
