"""Several deciders (proxies, EPPs) in front of one fleet share its polling through Redis.

With ``[proxy] shared_polling_ttl_s`` and a ``redis_url``, each decider registers in Redis
(a zset ``kvguard:{poll}:deciders`` of id -> expiry, renewed every third of the TTL by
``lua/shard_heartbeat.lua``; Redis's clock only) and owns the replicas that rendezvous hashing
over the live deciders gives it: the owner of a replica URL is the decider whose
``blake2b(id | url)`` is highest, so every decider computes the same owners from the same list
and a decider joining or leaving moves only its share. A decider polls only the replicas it
owns, applies what it read as before, and publishes each snapshot (the compact document, a
metrics page, or what the poll failed with) to a hash per replica
(``kvguard:{poll}:snap:<url hash>``, ``lua/shard_publish.lua``; an unchanged stream only moves
its time). The others read that hash once per refresh round (``lua/shard_read.lua``: the
snapshot only when its version changed) instead of the replica.

Freshness: a snapshot read from Redis is at most one owner refresh plus one reader refresh old
when all is well; its age at the last read (Redis's clock) is ``age_s`` and the decider that
polled it ``polled_by``, both shown per replica in the proxy's ``/kvguard/state``. A snapshot
older than the TTL (its owner is gone, or does not list that replica) is not used: the reader
polls the replica itself and publishes it, so a dead decider's shard is taken over within the
TTL even before its registration expires (then rendezvous hands the shard on for good).
Redis unreachable: every decider polls every replica itself, as without this setting.

Iteration samples: a reader that skips a version (it reads once per round) misses that
version's new step-time samples; the loads themselves are whole in every version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from guard.background import cancel_and_wait
from guard.budget.keys import PREFIX
from guard.errors import StateUnavailable
from guard.redact import redact_text
from guard.replicas.engine_metrics import EngineLoad
from guard.replicas.state_stream import UNCHANGED, StreamStateSource

__all__ = ["DECIDERS_KEY", "PollingShards", "SharedStateSource", "shards_for", "snapshot_key"]

log = logging.getLogger(__name__)

DECIDERS_KEY = f"{PREFIX}:{{poll}}:deciders"


def snapshot_key(url: str) -> str:
    """The replica's shared snapshot (the same Cluster slot as the deciders' zset)."""
    return f"{PREFIX}:{{poll}}:snap:{hashlib.sha1(url.encode('utf-8')).hexdigest()[:16]}"


def shards_for(config: Any) -> PollingShards | None:
    """The shared polling a guard config asks for (``[proxy] shared_polling_ttl_s``, with its
    ``redis_url``), or None; ValueError when it is asked for without Redis."""
    ttl_s = config.proxy.shared_polling_ttl_s
    if ttl_s is None:
        return None
    if config.redis_url is None:
        raise ValueError("proxy.shared_polling_ttl_s: needs redis_url (--redis)")
    return PollingShards(config.redis_url, ttl_s=ttl_s, timeout_s=config.state_timeout_s)


def _rank(decider_id: str, url: str) -> bytes:
    return hashlib.blake2b(f"{decider_id}|{url}".encode(), digest_size=8).digest()


class PollingShards:
    """This decider's place among those sharing the polling: its heartbeat, the live list,
    and the Redis calls of :class:`SharedStateSource`."""

    def __init__(self, redis_url: str, *, ttl_s: float, timeout_s: float = 0.5,
                 decider_id: str | None = None) -> None:
        if not ttl_s > 0:
            raise ValueError(f"shared_polling_ttl_s: must be > 0, got {ttl_s!r}")
        self.redis_url = redis_url
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.decider_id = decider_id or \
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.live: tuple[str, ...] = ()  # empty: Redis not reached, poll everything
        self._client: Any = None
        # imported here, not at the top: they import redis-py (~50 ms), which a proxy or EPP
        # started without Redis never needs (this class exists only with a Redis URL)
        from guard.budget.scripts import ScriptSet

        self._scripts = ScriptSet("guard.replicas",
                                  ("shard_heartbeat", "shard_publish", "shard_read"))
        self._task: asyncio.Task | None = None
        self._failing = False
        self._batch: list | None = None  # reads waiting for this iteration's call
        self._reads: set[asyncio.Task] = set()

    def owner(self, url: str) -> str | None:
        """The live decider that polls ``url`` (None: no list, this one polls it)."""
        if not self.live:
            return None
        return max(self.live, key=lambda decider: _rank(decider, url))

    def owns(self, url: str) -> bool:
        return self.owner(url) in (None, self.decider_id)

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            if self._client is None:
                from guard.budget.connection import connect  # redis-py: see __init__

                self._client = await asyncio.wait_for(
                    connect(self.redis_url, self.timeout_s), self.timeout_s)
                await self._scripts.load(self._client)
            result = await asyncio.wait_for(
                self._scripts.call(self._client, name, keys, args), self.timeout_s)
        except Exception as exc:
            client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()
            self.live = ()  # on our own until Redis answers again
            if not self._failing:
                self._failing = True
                log.warning("shared polling: redis unreachable (%s); polling every replica "
                            "here", redact_text(f"{type(exc).__name__}: {exc}"))
            raise
        if self._failing:
            self._failing = False
            log.info("shared polling: redis reached again")
        return result

    async def heartbeat(self) -> tuple[str, ...]:
        """Renew this decider's registration; the live list (empty when Redis failed)."""
        with contextlib.suppress(Exception):
            live = await self._call("shard_heartbeat", [DECIDERS_KEY],
                                    [self.decider_id, round(self.ttl_s * 1000)])
            before, self.live = self.live, tuple(sorted(_text(d) for d in live))
            if before != self.live:
                log.info("shared polling: %d deciders live: %s", len(self.live),
                         ", ".join(self.live))
        return self.live

    async def publish(self, url: str, kind: str, snapshot: str, error: str) -> None:
        """Write what this decider just read from ``url`` (never raises: readers then poll
        the replica themselves once the snapshot is older than the TTL)."""
        with contextlib.suppress(Exception):
            await self._call("shard_publish", [snapshot_key(url)],
                             [self.decider_id, kind, snapshot, error,
                              round(self.ttl_s * 10_000)])

    async def read(self, url: str, version: str) -> list:
        """``[Redis ms now, t, by, kind, version, error, snapshot]`` (``[now]`` when nothing
        is published). The reads asked for in one event-loop iteration (a poller round's)
        travel in one call."""
        if self._batch is None:
            self._batch = []
            asyncio.get_running_loop().call_soon(self._flush)
        future = asyncio.get_running_loop().create_future()
        self._batch.append((url, version, future))
        return await future

    def _flush(self) -> None:
        batch, self._batch = self._batch or [], None
        task = asyncio.get_running_loop().create_task(self._read_many(batch))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def _read_many(self, batch: list) -> None:
        try:
            result = await self._call("shard_read", [snapshot_key(url) for url, _, _ in batch],
                                      [version for _, version, _ in batch])
        except Exception as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        now_ms = result[0]
        for (_, _, future), record in zip(batch, result[1:], strict=True):
            if not future.done():
                future.set_result([now_ms, *record])

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.heartbeat()
            await asyncio.sleep(self.ttl_s / 3)

    async def stop(self) -> None:
        """Stop the heartbeat and leave the list (the others take this shard at once)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._call("shard_heartbeat", [DECIDERS_KEY], [self.decider_id, 0])
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SharedStateSource:
    """One replica's state: polled here (``inner``) while this decider owns it or the shared
    snapshot is older than the TTL, else read from Redis. ``polled_by`` and ``age_s`` say
    where the last state came from and how old it was then."""

    pushes = False  # read in the poller's rounds: each is published

    def __init__(self, inner: Any, url: str, shards: PollingShards, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.url = url
        self._shards = shards
        self._clock = clock
        self._polling = False  # inner is open here (owned or taken over)
        self._version = "-1"  # the version of the last snapshot read
        self._seen_t: int | None = None
        self._kind: str | None = None
        self._missing_since_s: float | None = None
        self.polled_by: str | None = None
        self.age_s: float | None = None
        self.num_polls = 0  # fetches from the replica itself
        self.num_reads = 0  # snapshots taken from Redis

    def __getattr__(self, name: str) -> Any:  # choice, reason, stream, max_model_len, ...
        if name in ("inner", "listen"):  # not pushed: every update is read in a round
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def kind(self) -> str:
        if self._polling or self._kind is None:
            return self.inner.kind
        return self._kind

    async def fetch(self) -> Any:
        if self._shards.owns(self.url):
            return await self._poll()
        try:
            record = await self._shards.read(self.url, self._version)
        except Exception:
            return await self._poll()  # Redis unreachable: on our own
        now_ms = int(record[0])
        if len(record) == 1:  # nothing published yet (or expired)
            now_s = self._clock()
            if self._missing_since_s is None:
                self._missing_since_s = now_s
            if now_s - self._missing_since_s >= self._shards.ttl_s:
                return await self._poll()
            return None
        self._missing_since_s = None
        published_ms, by, kind, version, error, snapshot = (_text(v) for v in record[1:])
        self.age_s = max(0.0, (now_ms - int(published_ms)) / 1000)
        if self.age_s > self._shards.ttl_s or by == self._shards.decider_id:
            # its poller is silent: take it over (until another decider publishes again)
            return await self._poll()
        await self._release()
        self.polled_by = by
        if int(published_ms) == self._seen_t:
            return None  # nothing new since the last round: the view stands, and ages
        self._seen_t = int(published_ms)
        if error:
            why = error[2:]
            if error.startswith("u:"):
                raise StateUnavailable(why)
            raise ConnectionError(f"polled by {by}: {why}")
        if not snapshot:
            return UNCHANGED
        self._version, self._kind = version, kind
        self.num_reads += 1
        return _decode(snapshot)

    async def _poll(self) -> Any:
        self._polling = True
        self.polled_by, self.age_s = self._shards.decider_id, 0.0
        self.num_polls += 1
        try:
            payload = await self.inner.fetch()
        except StateUnavailable as exc:
            await self._shards.publish(self.url, self.inner.kind, "", f"u:{exc}")
            raise
        except Exception as exc:
            await self._shards.publish(self.url, self.inner.kind, "",
                                       f"x:{type(exc).__name__}: {redact_text(str(exc))}")
            raise
        if payload is not None:
            await self._shards.publish(self.url, self.inner.kind, self._encode(payload), "")
        return payload

    async def _release(self) -> None:
        """Another decider polls it now: close what this one held open (a stream)."""
        if self._polling:
            self._polling = False
            close = getattr(self.inner, "aclose", None)
            if close is not None and (isinstance(self.inner, StreamStateSource)
                                      or getattr(self.inner, "stream", None) is not None):
                await close()

    def _encode(self, payload: Any) -> str:
        if payload is UNCHANGED:
            return ""
        stream = self.inner if isinstance(self.inner, StreamStateSource) \
            else getattr(self.inner, "stream", None)
        if stream is not None:  # GroupCaptures: the plain compact document instead
            payload = stream.document()
        if isinstance(payload, EngineLoad):
            return json.dumps({"engine_load": dataclasses.asdict(payload)})
        return json.dumps({"p": payload}, separators=(",", ":"))

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()


def _decode(snapshot: str) -> Any:
    data = json.loads(snapshot)
    if "engine_load" in data:
        return EngineLoad(**data["engine_load"])
    return data["p"]
