"""KV-cache events in vLLM's wire format: what a prefix-aware router subscribes to.

A batch is one msgpack array, as vLLM encodes its ``KVEventBatch`` (msgspec structs with
``array_like=True``; events are tagged with their class name as the first element)::

    [ts, [event, ...], data_parallel_rank]
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

``ts`` is wall-clock seconds (``time.time()``); hashes are ints in ``[0, 2**64)`` computed by
``engine.block_hash`` (a ``BlockStored`` whose first block starts a prompt has
``parent_block_hash`` None); ``token_ids`` are the stored blocks' tokens, concatenated;
``lora_id`` is always None and ``medium`` always ``"GPU"`` (the engine's one KV tier).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "MEDIUM",
    "decode_batch",
    "encode_batch",
]

MEDIUM = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one request became cached (their KV is computed)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int

    def as_wire(self) -> list:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash,
                list(self.token_ids), self.block_size, None, MEDIUM]


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted (their ids reused for other tokens)."""

    block_hashes: tuple[int, ...]

    def as_wire(self) -> list:
        return ["BlockRemoved", list(self.block_hashes), MEDIUM]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""

    def as_wire(self) -> list:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload (msgpack)."""
    import msgpack  # the engine extra; the block manager needs only the event types

    return msgpack.packb([float(ts), [e.as_wire() for e in events], data_parallel_rank])


def decode_batch(payload: bytes) -> tuple[float, list[KVCacheEvent]]:
    """The inverse of ``encode_batch`` (ignores the rank and any trailing fields vLLM may add).
    Raises ValueError on a payload that is not a KV event batch."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload)
        ts, raw_events = batch[0], batch[1]
        return float(ts), [_event(raw) for raw in raw_events]
    except (msgpack.UnpackException, ValueError, TypeError, IndexError, KeyError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


def _event(raw: list) -> KVCacheEvent:
    tag = raw[0]
    if tag == "BlockStored":
        return BlockStored(tuple(raw[1]), raw[2], tuple(raw[3]), int(raw[4]))
    if tag == "BlockRemoved":
        return BlockRemoved(tuple(raw[1]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event tag {tag!r}")
