"""KV-cache events from the replicas (vLLM's format), applied to the guard's prefix index.

A replica publishes its cache's changes over ZMQ (PUB); each message is ``[topic, seq,
payload]`` with ``seq`` an 8-byte big-endian counter and ``payload`` one msgpack
``KVEventBatch``, as vLLM's ``kv_events`` module encodes it: msgspec structs, each event
tagged with its class name. vLLM releases encode them as arrays (``array_like=True``, the
tag first; kvguard engines publish this form) or, the newest, as maps (the tag in ``type``);
both are read::

    [ts, [event, ...], data_parallel_rank]            {"ts": ..., "events": [...], ...}
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name, extra_keys, ...]                       {"type": "BlockStored", ...}
    ["BlockRemoved", block_hashes, medium, ...]
    ["AllBlocksCleared"]

Trailing fields a release adds (``group_idx``, cache-spec kinds, ...) are ignored. Block
hashes are ints in ``[0, 2**64)`` (kvguard, vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)
or bytes (vLLM's default; read as a big-endian int, at most 64 bytes).

Whose hashes they are decides how they are applied (``KvEvents(translated=...)``): a kvguard
engine's are kvguard's own chain, inserted as they are; any other engine's (vLLM) are
translated into kvguard's chain from the stored blocks' token ids
(:mod:`guard.replicas.kv_event_translation`).

Bad input never reaches the index: a batch from a replica the guard does not know, or one
that does not decode as a whole (not msgpack, a wrong shape, an unknown event, a hash out of
range; for a translated replica also token ids that are not the stored blocks'), is dropped
and logged, and counted in ``num_dropped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from guard.replicas.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from guard.replicas.kv_event_translation import BlockTranslator

__all__ = ["BlockRemoved", "BlockStored", "AllBlocksCleared", "KvEvent", "KvEventSubscriber",
           "KvEvents", "decode_batch", "resolve_endpoint"]

log = logging.getLogger("kvguard.kv_events")
_MAX_HASH = 1 << 64


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: Sequence[int] = ()  # the stored blocks' tokens, concatenated (not checked here)
    block_size: int = 0
    # a LoRA id or name, or extra keys (cache salt, multimodal inputs) on a block: part of the
    # engine's hash that kvguard's chain of token ids cannot say
    keyed: bool = False


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_MAX_HASH_BYTES = 64


def decode_batch(payload: bytes) -> list[KvEvent]:
    """Every event of one batch; ValueError (naming what is wrong) if any part is malformed."""
    import msgpack

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):  # newer vLLM: structs as maps
        if "ts" not in batch or "events" not in batch:
            raise ValueError("a batch map has ts and events")
        batch = [batch["ts"], batch["events"]]
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ValueError("a batch is [ts, events, ...]")
    if isinstance(batch[0], bool) or not isinstance(batch[0], (int, float)):
        raise ValueError("batch ts must be a number")
    if not isinstance(batch[1], (list, tuple)):
        raise ValueError("batch events must be an array")
    return [_event(raw) for raw in batch[1]]


def _event(raw: object) -> KvEvent:
    if isinstance(raw, dict):  # newer vLLM: {"type": tag, field: value, ...}
        raw = _from_map(raw)
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"an event is a tagged array, got {raw!r:.80}")
    tag = raw[0]
    if tag == "BlockStored" and len(raw) >= 5:
        return _stored(raw)
    if tag == "BlockRemoved" and len(raw) >= 2:
        return BlockRemoved(_hashes(raw[1]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown or short event {tag!r:.40}")


def _from_map(raw: dict) -> list:
    """A map-encoded event as the array form (its fields in vLLM's declared order)."""
    tag = raw.get("type")
    if tag == "BlockStored":
        names, num_required = _STORED_FIELDS, 4
    elif tag == "BlockRemoved":
        names, num_required = ("block_hashes",), 1
    else:
        names, num_required = (), 0
    missing = [n for n in names[:num_required] if n not in raw]
    if missing:
        raise ValueError(f"a {tag} event lacks {missing[0]}")
    return [tag, *(raw.get(n) for n in names)]


def _stored(raw: list | tuple) -> BlockStored:
    parent, token_ids, block_size = raw[2], raw[3], raw[4]
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError("token_ids must be an array")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r:.40}")
    extras = raw[5:9]  # lora_id, medium, lora_name, extra_keys (those present)
    lora_id = extras[0] if extras else None
    lora_name = extras[2] if len(extras) > 2 else None
    extra_keys = extras[3] if len(extras) > 3 else None
    keyed = lora_id is not None or lora_name is not None or (
        isinstance(extra_keys, (list, tuple)) and any(k is not None for k in extra_keys))
    return BlockStored(_hashes(raw[1]), None if parent is None else _hash(parent), token_ids,
                       block_size, keyed)


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError("block_hashes must be an array")
    return tuple(_hash(h) for h in value)


def _hash(value: object) -> int:
    if isinstance(value, bytes) and len(value) <= _MAX_HASH_BYTES:
        return int.from_bytes(value, "big")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_HASH:
        raise ValueError(f"a block hash must be an int in [0, 2**64) or at most "
                         f"{_MAX_HASH_BYTES} bytes, got {value!r:.40}")
    return value


class KvEvents:
    """Applies decoded batches to ``index`` for the replicas in ``known`` (a live view: the
    guard's configured replica ids). A replica for which ``translated(replica_id)`` is true
    publishes another engine's hashes: its events go through ``translator`` (a
    :class:`~guard.replicas.kv_event_translation.BlockTranslator` on the same index)."""

    def __init__(self, index: PrefixIndex, known: Collection[str], *,
                 translated: Callable[[str], bool] | None = None,
                 translator: BlockTranslator | None = None) -> None:
        self.index = index
        self.known = known
        self.translated = translated
        self.translator = translator
        self.num_applied = 0  # batches
        self.num_dropped = 0

    def apply(self, replica_id: str, payload: bytes) -> bool:
        """Apply one batch from ``replica_id``; False (logged, nothing applied) when dropped."""
        if replica_id not in self.known:
            return self.drop(replica_id, "unknown replica")
        try:
            events = decode_batch(payload)
            translator = self.translator
            if translator is not None and self.translated is not None \
                    and self.translated(replica_id):
                translator.check(events)
            else:
                translator = None
        except ValueError as exc:
            return self.drop(replica_id, str(exc))
        if translator is not None:
            translator.apply(replica_id, events)
        else:
            self._apply_native(replica_id, events)
        self.num_applied += 1
        return True

    def _apply_native(self, replica_id: str, events: list[KvEvent]) -> None:
        index = self.index
        for event in events:
            if isinstance(event, BlockStored):
                index.insert(replica_id, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                index.remove(replica_id, event.block_hashes)
            else:
                index.clear(replica_id)

    def drop(self, replica_id: str, why: str) -> bool:
        """Count and log a batch (or message) that is not applied."""
        self.num_dropped += 1
        log.warning("dropped a KV event batch from %r: %s", replica_id, why)
        return False


class KvEventSubscriber:
    """One ZMQ SUB socket per replica endpoint, feeding :meth:`KvEvents.apply` on the loop.

    ``on_gap(replica_id)`` is called when a sequence number is skipped (the PUB socket dropped
    messages at its high-water mark): the view can no longer trust that replica's blocks."""

    def __init__(self, events: KvEvents, on_gap: Callable[[str], None] | None = None) -> None:
        self.events = events
        self.on_gap = on_gap
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}
        self._context = None

    def endpoint(self, replica_id: str) -> str | None:
        entry = self._tasks.get(replica_id)
        return entry[0] if entry is not None else None

    def subscribe(self, replica_id: str, endpoint: str) -> None:
        """Listen to ``endpoint`` for ``replica_id`` (replacing an earlier endpoint)."""
        if self.endpoint(replica_id) == endpoint:
            return
        self.unsubscribe(replica_id)
        import zmq.asyncio

        if self._context is None:
            self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        task = asyncio.get_running_loop().create_task(self._run(replica_id, socket))
        self._tasks[replica_id] = (endpoint, task)

    def unsubscribe(self, replica_id: str) -> None:
        entry = self._tasks.pop(replica_id, None)
        if entry is not None:
            entry[1].cancel()

    async def _run(self, replica_id: str, socket) -> None:
        last_seq = None
        try:
            while True:
                parts = await socket.recv_multipart()
                if len(parts) != 3:
                    self.events.drop(replica_id, f"a message has 3 parts, got {len(parts)}")
                    continue
                seq = int.from_bytes(parts[1], "big")
                if last_seq is not None and seq != last_seq + 1 and self.on_gap is not None:
                    self.on_gap(replica_id)
                last_seq = seq
                self.events.apply(replica_id, parts[2])
        finally:
            socket.close(linger=0)

    async def aclose(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.term()
            self._context = None


def resolve_endpoint(endpoint: str, replica_url: str | None) -> str:
    """An advertised endpoint bound to every interface (``tcp://*:5557``,
    ``tcp://0.0.0.0:5557``) is reached at the replica's own host."""
    if not endpoint.startswith("tcp://") or replica_url is None:
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::"):
        replica_host = urlsplit(replica_url).hostname
        if replica_host:
            return f"tcp://{replica_host}:{port}"
    return endpoint
