"""The Redis budget store: the same buckets and leases as the memory store, shared by guards.

One Lua script per operation (``lua/reserve.lua``, ``settle.lua``, ``renew.lua``), time from
Redis ``TIME``, every key written with its TTL in the same script, keys hash-tagged per tenant
(works on a single server and on Redis Cluster).

Round trips: reserves of one tenant that arrive in the same event-loop iteration go out as one
EVALSHA (the script decides them in arrival order, exactly as separate calls would), with one
timer for the whole batch (``reserve_timeout_s``). Settles and releases are idempotent, so they
are queued without awaiting (:meth:`finish_soon`) and carried by the tenant's next reserve (or
flushed after ``settle_delay_s``); under steady traffic an admitted request costs at most one
script call in all. With ``settle_delay_s = 0`` each settle is its own call. :meth:`charge` (what
a guard decided on its local share while Redis was unusable) travels the same way. A batch's
requests and settles travel as two string arguments and its decisions come back as one string:
the client's cost is per argument and per reply element, far more than the server's.

Every reply carries the tenant's bucket levels after the call (:attr:`levels`, with the time they
were seen in :attr:`seen_s`): the local share starts from them when Redis goes away.

Errors: :meth:`reserve` raises the client's exception (``redis.exceptions.RedisError``,
``OSError``, ``asyncio.TimeoutError``) — :class:`~guard.budget.fallback.FallbackStore` turns that
into local enforcement. Settles and releases never raise: a failed flush is queued again
(bounded), and anything lost is reclaimed by lease expiry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from guard.budget.grant_pool import HOLD_S, GrantPool
from guard.budget.keys import tenant_keys
from guard.budget.memory_store import REFILL_S, check_reserve_args
from guard.budget.scripts import ScriptSet
from guard.budget.store import BudgetLimits, Denied, Grant

__all__ = ["RedisStore", "MAX_PENDING"]

log = logging.getLogger("kvguard.budget")
MAX_BATCH = 128  # reserves decided by one script call
MAX_PENDING = 10_000  # queued settles per tenant kept while Redis is unreachable
MAX_IN_FLIGHT = 16  # concurrent script calls: a burst reuses warm connections instead of
                    # opening one each (a cold connect costs several round trips)


def _limit_args(limits: BudgetLimits) -> list[int]:
    return [limits.tokens_per_minute or 0, limits.requests_per_minute or 0,
            limits.max_concurrent or 0]


def _finishes(items: list[tuple[str, int]]) -> str:
    """Settles and releases as the scripts' one string argument: "grant used ..." (-1: release)."""
    return " ".join(f"{gid} {used}" for gid, used in items)


def _fail(batch: list, exc: Exception) -> None:
    """Every request of ``batch`` still waiting gets ``exc``."""
    for *_, future in batch:
        if not future.done():
            future.set_exception(exc)


def _expire(batch: list) -> None:
    """A batch's reply did not come within the reserve timeout: its requests stop waiting (a
    grant that arrives later is given back; see :meth:`RedisStore._send_reserves`)."""
    for *_, future in batch:
        if not future.done():
            future.set_exception(TimeoutError("budget reserve: redis did not answer in time"))


class RedisStore:
    """:class:`~guard.budget.store.BudgetStore` on a ``redis.asyncio`` client (or RedisCluster)."""

    def __init__(self, client: Any, limits_for: Callable[[str], BudgetLimits],
                 scripts: ScriptSet | None = None, settle_delay_s: float = 0.02,
                 on_reclaim: Callable[[int], None] | None = None,
                 on_rtt: Callable[[float], None] | None = None,
                 reserve_timeout_s: float | None = None, reserve_ahead: bool = True,
                 live_guards: Callable[[], int] | None = None) -> None:
        if settle_delay_s < 0:
            raise ValueError(f"settle_delay_s: must be >= 0, got {settle_delay_s!r}")
        if reserve_timeout_s is not None and not reserve_timeout_s > 0:
            raise ValueError(f"reserve_timeout_s: must be > 0 or None, got {reserve_timeout_s!r}")
        self._reserve_timeout_s = reserve_timeout_s  # None: wait as long as the client does
        self._id_prefix = f"{os.urandom(8).hex()}-"  # grant ids: unique per store, then a count
        self._next_id = 0
        self.client = client
        self.scripts = scripts or ScriptSet()
        self._limits_for = limits_for
        self._settle_delay_s = settle_delay_s
        self._on_reclaim = on_reclaim
        self._on_rtt = on_rtt
        self._pending: dict[str, list[tuple[str, int]]] = {}
        self._flusher: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Task] = set()
        self._slots: asyncio.Semaphore | None = None
        self._batches: dict[str, list[tuple[str, int, int, asyncio.Future]]] = {}
        self.remaining: dict[str, float] = {}  # tenant -> tokens left after its last reserve
        self.levels: dict[str, tuple[float | None, float | None]] = {}  # tenant -> (tokens,
        # requests) left after its last reserve or settle, None where unlimited
        self.seen_s: dict[str, float] = {}  # tenant -> when ``levels`` was last refreshed
        self._charges: dict[str, list[float]] = {}  # tenant -> [tokens, requests] to take
        self.pool = GrantPool(time.monotonic, live_guards or (lambda: 1))
        self._reserve_ahead = reserve_ahead
        self._ahead: dict[str, tuple[int, int]] = {}  # tenant -> (tokens, lease_ms) per grant
        self._ahead_in_flight: dict[str, int] = {}  # tenant -> grants asked ahead, unanswered

    def reserve_now(self, tenant: str, tokens: int, lease_s: float, *, top_up: bool = True,
                    max_age_s: float = HOLD_S) -> Grant | None:
        """A grant reserved ahead (:mod:`guard.budget.grant_pool`) when one no older than
        ``max_age_s`` is held for the tenant and fits ``tokens``; None: await :meth:`reserve`
        (Redis decides). ``top_up=False``: no top-up call (Redis unusable)."""
        check_reserve_args(tenant, tokens, lease_s)
        return self.take_held(tenant, tokens, top_up, max_age_s)

    def take_held(self, tenant: str, tokens: int, top_up: bool = True,
                  max_age_s: float = HOLD_S) -> Grant | None:
        """:meth:`reserve_now` for arguments already checked (the fallback store's path)."""
        pool = self.pool
        taken = pool.take(tenant, tokens, max_age_s)
        if pool.stale:
            self.release_expired()
        if taken is None:
            return None
        if top_up and not self._ahead_in_flight.get(tenant) and pool.low(tenant):
            self._batch(tenant)  # top the pool up in the background (joins this loop's batch)
        return Grant(tenant, taken[0], taken[1])

    async def reserve(self, tenant: str, tokens: int, lease_s: float) -> Grant | Denied:
        """Decided by Redis (raises the client's error, or TimeoutError past
        ``reserve_timeout_s``)."""
        check_reserve_args(tenant, tokens, lease_s)
        future = asyncio.get_running_loop().create_future()
        batch = self._batch(tenant)
        batch.append((self._grant_id(), tokens, max(1, int(lease_s * 1000)), future))
        return await future

    def _batch(self, tenant: str) -> list:
        """The tenant's batch for this loop iteration (sent once the iteration's arrivals are
        in; reserves ahead are added when it is sent)."""
        batch = self._batches.get(tenant)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._batches[tenant] = []
            timer = None  # one timer per batch, from its first arrival
            if self._reserve_timeout_s is not None:
                timer = loop.call_later(self._reserve_timeout_s, _expire, batch)
            self._spawn(self._send_batch(tenant, batch, timer))  # after this iteration's arrivals
        return batch

    def _grant_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}{self._next_id:x}"

    async def _send_batch(self, tenant: str, batch: list,
                          timer: asyncio.TimerHandle | None) -> None:
        if self._batches.get(tenant) is batch:
            del self._batches[tenant]
        try:
            for start in range(0, max(1, len(batch)), MAX_BATCH):
                await self._send_reserves(tenant, batch[start:start + MAX_BATCH])
        finally:
            if timer is not None:
                timer.cancel()

    async def _send_reserves(self, tenant: str, batch: list) -> None:
        limits = self._limits_for(tenant)
        ahead, ahead_size, ahead_lease_ms = self._ahead_of(tenant, limits, batch)
        if not batch and not ahead:
            return  # a top-up no longer wanted
        pending = self._pending.pop(tenant, [])
        charge = self._charges.pop(tenant, [0.0, 0.0])
        reserves = [f"{gid} {tokens} {lease_ms}" for gid, tokens, lease_ms, _ in batch]
        if ahead:  # one size and lease for all: formatted once
            suffix = f" {ahead_size} {ahead_lease_ms}"
            reserves.extend([gid + suffix for gid in ahead])
        args = [*_limit_args(limits), *charge, " ".join(reserves), _finishes(pending)]
        self._ahead_in_flight[tenant] = self._ahead_in_flight.get(tenant, 0) + len(ahead)
        try:
            reply = await self._call("reserve", tenant_keys(tenant), args)
        except BaseException as exc:
            self._requeue(tenant, pending)
            self._recharge(tenant, charge)
            # grants asked ahead that Redis may have made all the same: released (a no-op for
            # one it did not make), not left to their lease
            self._requeue(tenant, [(grant_id, -1) for grant_id in ahead])
            _fail(batch, exc if isinstance(exc, Exception) else
                  ConnectionError("budget reserve interrupted"))
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self._ahead_in_flight[tenant] -= len(ahead)
        reclaimed = int(reply[0])
        if reclaimed and self._on_reclaim is not None:
            self._on_reclaim(reclaimed)
        decisions = str(reply[3]).split(" ")
        if len(decisions) != len(batch) + len(ahead):  # a script not matching this client
            _fail(batch, RuntimeError(f"budget reserve: {len(decisions)} decisions for "
                                      f"{len(batch) + len(ahead)} requests"))
            return
        if ahead:
            self.pool.add_many(tenant, [grant_id for decision, grant_id
                                        in zip(decisions[len(batch):], ahead, strict=True)
                                        if decision == "1"], ahead_size, ahead_lease_ms / 1000)
        self._saw_levels(tenant, limits, reply[1], reply[2])  # after the pool: may drain it
        for decision, (grant_id, tokens, _, future) in zip(decisions[:len(batch)], batch,
                                                           strict=True):
            if decision == "1":
                outcome: Grant | Denied = Grant(tenant, grant_id, tokens)
            else:
                reason, _, retry_ms = decision.partition(":")
                wait_ms = float(retry_ms)
                outcome = Denied(reason, None if wait_ms < 0 else wait_ms / 1000)
            if not future.done():
                future.set_result(outcome)
            elif isinstance(outcome, Grant):  # its caller gave up waiting: give it back
                self._requeue(tenant, [(grant_id, -1)])
                self._schedule(self._settle_delay_s)

    async def settle(self, grant: Grant, used_tokens: int) -> None:
        await self._queue(grant, max(0, int(used_tokens)))

    async def release(self, grant: Grant) -> None:
        await self._queue(grant, -1)

    def finish_soon(self, grant: Grant, used_tokens: int | None) -> None:
        """Settle (``used_tokens``) or release (None) without awaiting: queued for the tenant's
        next reserve or the next flush (with ``settle_delay_s = 0``, a flush starts now)."""
        if used_tokens is None:
            used = -1
        elif used_tokens.__class__ is int and used_tokens >= 0:
            used = used_tokens
        else:
            used = max(0, int(used_tokens))
        queue = self._pending.get(grant.tenant)  # _requeue() of one, without the list
        if queue is None:
            queue = self._pending[grant.tenant] = []
        queue.append((grant.grant_id, used))
        if len(queue) > MAX_PENDING:
            del queue[: len(queue) - MAX_PENDING]
        if self._settle_delay_s == 0:
            self._spawn(self.flush())
        elif self._flusher is None:
            self._schedule(self._settle_delay_s)

    def charge(self, tenant: str, tokens: float, requests: float) -> None:
        """Take ``tokens`` and ``requests`` from the tenant's shared bucket (negative: give back),
        carried by its next reserve or the next flush. Never raises."""
        if tokens or requests:
            self._recharge(tenant, [tokens, requests])
            self._schedule(self._settle_delay_s)

    def _recharge(self, tenant: str, charge: list[float]) -> None:
        if charge[0] or charge[1]:
            held = self._charges.setdefault(tenant, [0.0, 0.0])
            held[0] += charge[0]
            held[1] += charge[1]

    def pending_charge(self, tenant: str) -> tuple[float, float]:
        """What :meth:`charge` queued for the tenant and Redis has not taken yet."""
        tokens, requests = self._charges.get(tenant, (0.0, 0.0))
        return tokens, requests

    def remaining_now(self, tenant: str) -> tuple[float | None, float | None] | None:
        """(tokens, requests) left in the tenant's shared buckets as Redis last answered,
        refilled since at the limits' rates, plus the grants held ahead (still this guard's
        to give); None on an unlimited axis, or None when Redis has not answered for it yet."""
        levels = self.levels.get(tenant)
        if levels is None:
            return None
        limits = self._limits_for(tenant)
        elapsed_s = time.monotonic() - self.seen_s.get(tenant, time.monotonic())
        held = self.pool.held_amount(tenant)
        out = []
        for level, limit, extra in ((levels[0], limits.tokens_per_minute, held[0]),
                                    (levels[1], limits.requests_per_minute, held[1])):
            if level is None or limit is None:
                out.append(None)
            else:
                out.append(min(float(limit), level + elapsed_s * limit / REFILL_S) + extra)
        return out[0], out[1]

    def _saw_levels(self, tenant: str, limits: BudgetLimits, tokens: Any, requests: Any) -> None:
        if limits.tokens_per_minute is not None:
            self.remaining[tenant] = float(tokens)
        levels = self.levels[tenant] = (
            float(tokens) if limits.tokens_per_minute is not None else None,
            float(requests) if limits.requests_per_minute is not None else None)
        self.seen_s[tenant] = time.monotonic()
        if self.pool.num_held(tenant) and not self.pool.far_from_limit(tenant, limits, levels):
            self._give_back({tenant: self.pool.drain(tenant)})  # nearing the limit

    def _ahead_of(self, tenant: str, limits: BudgetLimits,
                  batch: list) -> tuple[list[str], int, int]:
        """The reserves ahead to add to ``batch``: the ids of as many grants as the pool wants,
        each of 1.5 × the batch's largest size (a top-up with no request of its own: the last
        size), and that size and their lease in ms."""
        if not self._reserve_ahead:
            return [], 0, 0
        if batch:
            largest = max(t for _, t, _, _ in batch)  # with room: sizes vary a little
            self._ahead[tenant] = (largest + largest // 2 + 1, max(m for _, _, m, _ in batch))
            self.pool.saw_batch(tenant, len(batch))
        size, lease_ms = self._ahead.get(tenant, (0, 0))
        want = self.pool.wanted(tenant, limits, self.levels.get(tenant), size)
        want = min(want - self._ahead_in_flight.get(tenant, 0), MAX_BATCH - len(batch))
        if want <= 0:
            return [], size, lease_ms
        first, self._next_id = self._next_id + 1, self._next_id + want  # _grant_id(), want times
        prefix = self._id_prefix
        return [f"{prefix}{n:x}" for n in range(first, first + want)], size, lease_ms

    def release_expired(self) -> None:
        """Held grants unused for ``HOLD_S`` go back (queued releases)."""
        expired = self.pool.expired()
        for tenant, grant_id in self.pool.stale:
            expired.setdefault(tenant, []).append(grant_id)
        self.pool.stale.clear()
        self._give_back(expired)

    def release_held(self) -> None:
        """Every held grant goes back (Redis unusable, or closing)."""
        self._give_back({t: self.pool.drain(t) for t in self.pool.tenants()})

    def _give_back(self, grants: dict[str, list[str]]) -> None:
        for tenant, ids in grants.items():
            if ids:
                self._requeue(tenant, [(grant_id, -1) for grant_id in ids])
                self._schedule(self._settle_delay_s)

    def forget_levels(self) -> None:
        """Drop every level seen (Redis lost them: they describe buckets that are gone)."""
        self.levels.clear()
        self.seen_s.clear()
        self.remaining.clear()

    async def refresh(self, tenants: Sequence[str]) -> None:
        """Read the levels of ``tenants`` again (one settle call each, concurrently, carrying
        anything queued for them). Raises on Redis trouble."""
        await asyncio.gather(*(self._flush_tenant(t, self._pending.pop(t, []), raise_errors=True)
                               for t in tenants))

    async def renew(self, grants: Sequence[Grant], lease_s: float) -> None:
        """Extend the leases of ``grants`` (one call per tenant). Raises on Redis trouble."""
        by_tenant: dict[str, list[str]] = {}
        for grant in grants:
            by_tenant.setdefault(grant.tenant, []).append(grant.grant_id)
        lease_ms = max(1, int(lease_s * 1000))
        for tenant, ids in by_tenant.items():
            await self._call("renew", tenant_keys(tenant), [lease_ms, *ids])

    async def flush(self) -> bool:
        """Send every queued settle, release and charge now (errors: queued again, logged).
        True when everything queued was delivered."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        pending, self._pending = self._pending, {}
        delivered = True
        for tenant in [*pending, *(t for t in self._charges if t not in pending)]:
            delivered = await self._flush_tenant(tenant, pending.get(tenant, [])) and delivered
        return delivered

    async def _flush_tenant(self, tenant: str, items: list[tuple[str, int]],
                            raise_errors: bool = False) -> bool:
        limits = self._limits_for(tenant)
        charge = self._charges.pop(tenant, [0.0, 0.0])
        args = [*_limit_args(limits)[:2], *charge, _finishes(items)]
        try:
            reply = await self._call("settle", tenant_keys(tenant), args)
        except Exception as exc:  # noqa: BLE001 - never raise from settle; leases expire
            log.debug("budget settle for %s deferred: %r", tenant, exc)
            self._requeue(tenant, items)
            self._recharge(tenant, charge)
            self._schedule(max(1.0, self._settle_delay_s))
            if raise_errors:
                raise
            return False
        self._saw_levels(tenant, limits, reply[1], reply[2])
        return True

    async def aclose(self) -> None:
        self.release_held()
        try:
            await asyncio.wait_for(self.flush(), timeout=1.0)
        except (asyncio.TimeoutError, OSError):
            pass
        for task in list(self._flushing):
            task.cancel()
        close = getattr(self.client, "aclose", None) or self.client.close
        await close()

    async def warm(self) -> None:
        """Open the connections a burst will use (``MAX_IN_FLIGHT`` concurrent PINGs: redis-py
        opens that many; the budget's own client pipelines them on its one connection)."""
        await asyncio.gather(*(self.client.ping() for _ in range(MAX_IN_FLIGHT)))

    def num_pending(self) -> int:
        """Queued settles and releases, plus tenants with a queued charge."""
        return sum(len(items) for items in self._pending.values()) + len(self._charges)

    # --- internals ------------------------------------------------------------------------

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        async with self._slots:
            start_s = time.perf_counter()
            reply = await self.scripts.call(self.client, name, keys, args)
            if self._on_rtt is not None:
                self._on_rtt(time.perf_counter() - start_s)
        return reply

    async def _queue(self, grant: Grant, used: int) -> None:
        self._requeue(grant.tenant, [(grant.grant_id, used)])
        if self._settle_delay_s == 0:
            await self.flush()
        else:
            self._schedule(self._settle_delay_s)

    def _schedule(self, delay_s: float) -> None:
        if self._flusher is None:
            loop = asyncio.get_running_loop()
            self._flusher = loop.call_later(delay_s, self._start_flush)

    def _start_flush(self) -> None:
        self._flusher = None
        self._spawn(self.flush())

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    def _requeue(self, tenant: str, items: list[tuple[str, int]]) -> None:
        if not items:
            return
        queue = self._pending.setdefault(tenant, [])
        queue.extend(items)
        if len(queue) > MAX_PENDING:  # the oldest go: their leases expire and refund in Redis
            del queue[: len(queue) - MAX_PENDING]
