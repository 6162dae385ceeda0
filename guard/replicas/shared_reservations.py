"""KV reservations shared by every guard in front of the same replicas, through Redis.

Each guard's pending reservations (admitted, not yet reported by the replica: they cover the
scrape lag) are published per replica — a hash of ``guard|request id -> load`` and a lease zset,
keys ``kvguard:{kv-<replica>}:...`` (one Cluster slot per replica), every entry leased for
``lease_s`` and renewed by its guard while pending — and each guard's load snapshot subtracts
the **other** guards' entries (:meth:`guard.replicas.load_state.LoadState.set_foreign`; its own
are filtered out by the script, so nothing counts twice). A foreign entry stops counting when
the replica lists its request id (or, for vLLM, once a scrape that started after it was first
seen is applied) — as this guard's own reservations do — or when its guard withdraws it.

One script (``lua/kv_sync.lua``) per replica does it all in one round trip: reap expired
entries, write this guard's new entries, delete the ended ones, renew the pending ones, and
return everyone else's. Changes made in one event-loop iteration travel in one call.

Admission is optimistic: the policy decides on the view it has, the reservation is published,
and :meth:`SharedReservations.confirm` waits for that call (one round trip on the admission
path) and says whether another guard's entry appeared on that replica since the decision —
Redis runs the scripts one at a time, so of two guards racing for the same blocks the later one
always sees the earlier one and decides again on a view that includes it.

Redis unreachable or slow (``timeout_s`` per call, ``FAILURES_TO_LOCAL`` in a row): local-only
reservations (the foreign view is dropped), a warning in the log,
``kvguard_kv_reservations_shared 0``; requests are never failed or held for it; the periodic
sync (every ``sync_interval_s``) reconnects and publishes everything still pending again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from guard.budget.keys import PREFIX
from guard.redact import redact_url
from policies.cost import RequestClass, RequestCost

if TYPE_CHECKING:
    from guard.replicas.load_state import LoadState

__all__ = ["SharedReservations", "replica_keys", "encode_load", "decode_load"]

log = logging.getLogger("kvguard.reservations")
FAILURES_TO_LOCAL = 3  # consecutive failed calls before falling back to local-only
CONNECT_TIMEOUT_S = 0.5  # reconnects run off the request path


def replica_keys(replica_url: str) -> list[str]:
    """The replica's entries hash and lease zset (one Cluster slot, named by its URL)."""
    tag = hashlib.sha1(replica_url.encode("utf-8")).hexdigest()[:16]
    return [f"{PREFIX}:{{kv-{tag}}}:entries", f"{PREFIX}:{{kv-{tag}}}:leases"]


def encode_load(cost: RequestCost) -> str:
    return (f"{cost.num_blocks},{cost.num_prompt_tokens},{cost.num_expected_output_tokens},"
            f"{cost.request_class.itl_s!r},{cost.request_id}")


def decode_load(text: str, now_s: float, classes: dict[float, RequestClass]) -> RequestCost:
    """A published entry as a cost (ValueError when malformed)."""
    blocks, prompt, output, itl_s, request_id = text.split(",", 4)
    itl = float(itl_s)
    cls = classes.get(itl)
    if cls is None:
        cls = classes[itl] = RequestClass(f"shared-itl-{itl}", 1e9, itl)
    return RequestCost(request_id, "", cls, int(prompt), int(output), int(output), int(blocks),
                       now_s, now_s)


class SharedReservations:
    """Publishes this guard's pending reservations and feeds the others' into its load state.

    ``replica_urls``: replica id -> URL (the URL names the replica across guards, whose ids
    may differ). :meth:`bind` attaches it to the controller's load state and registry.
    """

    def __init__(self, url: str, replica_urls: Mapping[str, str], *, timeout_s: float,
                 lease_s: float, sync_interval_s: float) -> None:
        if not timeout_s > 0 or not lease_s > 0 or not sync_interval_s > 0:
            raise ValueError("shared reservations: timeout_s, lease_s and sync_interval_s "
                             "must be > 0")
        self._url = url
        self._keys = {rid: replica_keys(u) for rid, u in replica_urls.items()}
        self._timeout_s = timeout_s
        self._lease_ms = max(1, int(lease_s * 1000))
        self._sync_interval_s = sync_interval_s
        self.instance = uuid.uuid4().hex[:12]
        self._prefix = self.instance + "|"
        # imported here, not at the top: it imports redis-py (~50 ms), which a proxy or EPP
        # started without Redis never needs (this class exists only with a Redis URL)
        from guard.budget.scripts import ScriptSet

        self._scripts = ScriptSet("guard.replicas", ("kv_sync",))
        self._client: Any = None
        self.shared = False  # syncing through Redis (False: local-only reservations)
        self._failures = 0
        self._own: dict[str, dict[str, str]] = {rid: {} for rid in self._keys}  # pending, encoded
        self._adds: dict[str, set[str]] = {rid: set() for rid in self._keys}
        self._removes: dict[str, set[str]] = {rid: set() for rid in self._keys}
        self._next: dict[str, asyncio.Future] = {}  # the sync not yet sent, per replica
        self._locks: dict[str, asyncio.Lock] = {}
        self.version: dict[str, int] = {rid: 0 for rid in self._keys}  # foreign entries added
        self._classes: dict[float, RequestClass] = {}
        self._load_state: LoadState | None = None
        self._clock: Callable[[], float] = time.monotonic
        self._task: asyncio.Task | None = None
        self._closing = False
        self._shared_gauge: Gauge | None = None
        self.redecided: Counter | None = None

    def bind(self, load_state: LoadState, registry: CollectorRegistry,
             clock: Callable[[], float]) -> None:
        self._load_state = load_state
        self._clock = clock
        load_state.pending_listener = self
        self._shared_gauge = Gauge("kvguard_kv_reservations_shared",
                                   "1 while pending KV reservations are shared with the other "
                                   "guards through Redis, 0 while local-only", registry=registry)
        self.redecided = Counter("kvguard_kv_reservations_redecided",
                                 "Admissions decided again because another guard reserved on "
                                 "the same replica first", registry=registry)

    # --- the load state's listener (own reservations) --------------------------------------

    # --- fleet membership -------------------------------------------------------------------

    def add_replica(self, replica_id: str, url: str) -> None:
        """A replica joined the fleet: its reservations are shared from now on."""
        if replica_id in self._keys:
            return
        self._keys[replica_id] = replica_keys(url)
        self._own[replica_id], self._adds[replica_id], self._removes[replica_id] = {}, set(), set()
        self.version[replica_id] = 0

    def remove_replica(self, replica_id: str) -> None:
        """A replica left the fleet (none of this guard's requests is in flight there)."""
        for table in (self._keys, self._own, self._adds, self._removes, self.version,
                      self._locks):
            table.pop(replica_id, None)

    def pending_added(self, replica_id: str, request_id: str, cost: RequestCost) -> None:
        if replica_id not in self._own:
            return
        self._own[replica_id][request_id] = encode_load(cost)
        self._removes[replica_id].discard(request_id)
        self._adds[replica_id].add(request_id)
        self._ensure_started()

    def pending_ended(self, replica_id: str, request_id: str) -> None:
        if replica_id not in self._own:
            return
        self._own[replica_id].pop(request_id, None)
        self._adds[replica_id].discard(request_id)
        if self.shared:  # local-only: nothing to withdraw (what Redis holds expires)
            self._removes[replica_id].add(request_id)

    # --- admission ----------------------------------------------------------------------------

    async def confirm(self, replica_id: str, version: int) -> bool:
        """Publish what is queued for ``replica_id`` (this admission's reservation among it)
        and say whether no other guard's entry appeared there since ``version`` was read.
        True too when Redis cannot tell (local-only)."""
        if replica_id not in self._keys or not self.shared:
            return True
        if not await self.sync(replica_id):
            return True
        return self.version.get(replica_id, version) == version

    async def sync(self, replica_id: str) -> bool:
        """Join (or start) the next sync of ``replica_id``; True when it reached Redis."""
        future = self._next.get(replica_id)
        if future is None:
            future = self._next[replica_id] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._run_sync(replica_id, future))
        return await asyncio.shield(future)

    async def _run_sync(self, replica_id: str, future: asyncio.Future) -> None:
        lock = self._locks.setdefault(replica_id, asyncio.Lock())
        async with lock:
            if self._next.get(replica_id) is future:
                del self._next[replica_id]  # from here on, new changes go to the next sync
            ok = await self._send(replica_id)
        if not future.done():
            future.set_result(ok)

    async def _send(self, replica_id: str) -> bool:
        if self._client is None or replica_id not in self._keys:
            return False
        own = self._own[replica_id]
        adds, self._adds[replica_id] = self._adds[replica_id], set()
        removes, self._removes[replica_id] = self._removes[replica_id], set()
        args: list[Any] = [self._prefix, self._lease_ms, len(adds)]
        for request_id in adds:
            args += [request_id, own.get(request_id, "")]
        args += [len(removes), *removes, *(r for r in own if r not in adds)]
        try:
            reply = await asyncio.wait_for(
                self._scripts.call(self._client, "kv_sync", self._keys[replica_id], args),
                self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - any Redis trouble: local-only
            self._adds[replica_id] |= {r for r in adds if r in own}
            self._removes[replica_id] |= removes
            self._failed(exc)
            return False
        self._failures = 0
        self._apply(replica_id, reply)
        return True

    def _apply(self, replica_id: str, reply: list) -> None:
        now_s = self._clock()
        entries = {}
        for i in range(0, len(reply) - 1, 2):
            try:
                entries[str(reply[i])] = decode_load(str(reply[i + 1]), now_s, self._classes)
            except ValueError:
                log.debug("shared reservation %r: malformed entry skipped", reply[i])
        if self._load_state is not None and self.shared and replica_id in self.version:
            self.version[replica_id] += self._load_state.set_foreign(replica_id, entries, now_s)

    def _failed(self, exc: BaseException) -> None:
        self._failures += 1
        log.debug("shared reservations: redis call failed: %r", exc)
        if self.shared and self._failures >= FAILURES_TO_LOCAL:
            self._set_shared(False)

    def _set_shared(self, shared: bool) -> None:
        if shared == self.shared:
            return
        self.shared = shared
        if shared:
            log.info("KV reservations: shared with the other guards through redis (%s)",
                        redact_url(self._url))
            for replica_id, own in self._own.items():  # publish everything still pending
                self._adds[replica_id] |= set(own)
        else:
            log.warning("KV reservations: redis unreachable, local-only (other guards' "
                        "admissions are not subtracted until it answers)")
            for removes in self._removes.values():
                removes.clear()  # their leases expire in Redis
            if self._load_state is not None:
                for replica_id in list(self._keys):
                    self._load_state.set_foreign(replica_id, {}, self._clock())
        if self._shared_gauge is not None:
            self._shared_gauge.set(1 if shared else 0)

    # --- background: connect, then sync every replica each interval ------------------------

    def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is None and not self._closing:
            self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self._closing:
            try:
                if self._client is None:
                    from guard.budget.connection import connect  # redis-py: see __init__

                    self._client = await asyncio.wait_for(connect(self._url, CONNECT_TIMEOUT_S),
                                                          CONNECT_TIMEOUT_S * 2)
                if not self.shared:
                    await asyncio.wait_for(self._scripts.load(self._client), CONNECT_TIMEOUT_S)
                    self._set_shared(True)
                for replica_id in list(self._keys):  # the fleet may change meanwhile
                    await self.sync(replica_id)
            except Exception as exc:  # noqa: BLE001 - keep serving local-only, retry
                self._failed(exc)
            await asyncio.sleep(self._sync_interval_s)

    async def aclose(self) -> None:
        """Withdraw this guard's entries (best effort) and stop."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
            self._task = None
        if self._client is not None:
            if self.shared:
                for replica_id, own in list(self._own.items()):
                    self._removes[replica_id] |= set(own)
                    own.clear()
                    self._adds[replica_id].clear()
                    try:
                        await self._send(replica_id)
                    except Exception:  # noqa: BLE001 - leases expire anyway
                        pass
            close = getattr(self._client, "aclose", None) or self._client.close
            await close()
            self._client = None
