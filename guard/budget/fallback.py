"""Redis budgets that survive Redis: a breaker, a local share, and a background reconnect.

:class:`FallbackStore` is what a guard with a ``redis_url`` uses. While Redis answers, every
reserve is one script call bounded by ``redis_timeout_s``. After ``breaker_failures``
consecutive failures (a timeout, a refused connection, a hung server) the breaker opens and the
guard enforces a **local share** of each limit — the limit divided by the number of guards last
seen live in Redis (each guard heartbeats every ``heartbeat_s``) — in its own memory store, whose
buckets start from their share of what Redis last reported left (an outage never re-grants
budget the shared bucket had already spent), and a
background task reconnects on a tenacity backoff (capped at ``retry_max_s``), reloads the
scripts, and closes the breaker. Start-up without Redis is the same state: local share, retrying
(the very first requests wait, once and at most ``STARTUP_WAIT_S``, until Redis answers or refuses,
so a guard that is merely still connecting does not hand out a local share on top of Redis).

Grants remember where they were made: a local grant is settled locally and never charged to
Redis (no double counting after recovery); a Redis grant whose settle cannot be delivered is
retried, and if that is lost too, its lease expires and Redis reclaims it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from guard.budget.breaker import Breaker
from guard.budget.config import BudgetConfig
from guard.budget.connection import connect
from guard.budget.keys import LIVE_GUARDS_KEY
from guard.budget.memory_store import MemoryStore, check_reserve_args
from guard.budget.metrics import BudgetMetrics
from guard.budget.redis_store import RedisStore
from guard.budget.store import BudgetLimits, Denied, Grant

__all__ = ["FallbackStore"]

log = logging.getLogger("kvguard.budget")
PROBE_TIMEOUT_S = 0.5  # reconnect probes (not on the request path) may wait this long
STARTUP_WAIT_S = 1.0  # the first requests wait this long, once, for the first connect attempt


async def _bounded(work: Awaitable[Any], timeout_s: float) -> Any:
    """``work`` or TimeoutError after ``timeout_s`` (3.11+: ``asyncio.timeout``, no extra task)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await work
    return await asyncio.wait_for(work, timeout_s)


def _share(limits: BudgetLimits, num_guards: int) -> BudgetLimits:
    def part(value: int | None) -> int | None:
        return None if value is None else max(1, value // num_guards)
    return BudgetLimits(part(limits.tokens_per_minute), part(limits.requests_per_minute),
                        part(limits.max_concurrent))


class FallbackStore:
    """:class:`~guard.budget.store.BudgetStore` on Redis with a local-share fallback."""

    def __init__(self, url: str, limits_for: Callable[[str], BudgetLimits], config: BudgetConfig,
                 clock: Callable[[], float], metrics: BudgetMetrics | None = None,
                 instance_id: str | None = None) -> None:
        self._url = url
        self._limits_for = limits_for
        self._config = config
        self._metrics = metrics
        self.instance_id = instance_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.breaker = Breaker(config.breaker_failures, self._on_breaker)
        self.breaker.is_open = True  # until the first connect succeeds (start-up: local share)
        self.live_guards = 1
        self.local = MemoryStore(self._local_limits, clock, on_reclaim=self._reclaimed)
        self.redis: RedisStore | None = None
        self._local_ids: set[str] = set()
        self.num_local_reserves = 0  # reserves decided on the local share (Redis unusable)
        self._shares: dict[str, BudgetLimits] = {}
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._first_attempt: asyncio.Event | None = None  # set once the first probe has ended
        self._startup_deadline_s = 0.0  # loop time after which requests stop waiting for it
        if metrics is not None:
            metrics.watch_remaining(self.remaining_tokens)

    @property
    def backend(self) -> str:
        return "local" if self.breaker.is_open else "redis"

    async def reserve(self, tenant: str, tokens: int, lease_s: float) -> Grant | Denied:
        check_reserve_args(tenant, tokens, lease_s)
        self._ensure_started()
        if not self._first_attempt.is_set():  # start-up: a local grant now would be on top of
            await self._await_first_attempt()  # the shared budget, so give Redis a moment
        if not self.breaker.is_open and self.redis is not None:
            try:
                outcome = await _bounded(self.redis.reserve(tenant, tokens, lease_s),
                                         self._config.redis_timeout_s)
            except Exception as exc:  # noqa: BLE001 - any Redis trouble: serve locally
                log.debug("budget reserve on redis failed: %r", exc)
                self.breaker.record_failure()
            else:
                self.breaker.record_success()
                return outcome
        self.num_local_reserves += 1
        outcome = self.local.reserve_now(tenant, tokens, lease_s)
        if isinstance(outcome, Grant):
            self._local_ids.add(outcome.grant_id)
        return outcome

    async def _await_first_attempt(self) -> None:
        """Wait until Redis answered or refused, but never past the start-up window."""
        left_s = self._startup_deadline_s - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._first_attempt.wait(), max(0.0, left_s))
        except asyncio.TimeoutError:
            self._first_attempt.set()  # a hung Redis at start-up: local share from now on

    async def settle(self, grant: Grant, used_tokens: int) -> None:
        if grant.grant_id in self._local_ids:
            self._local_ids.discard(grant.grant_id)
            await self.local.settle(grant, used_tokens)
        elif self.redis is not None:
            await self.redis.settle(grant, used_tokens)

    async def release(self, grant: Grant) -> None:
        if grant.grant_id in self._local_ids:
            self._local_ids.discard(grant.grant_id)
            await self.local.release(grant)
        elif self.redis is not None:
            await self.redis.release(grant)

    async def renew(self, grants: Sequence[Grant], lease_s: float) -> None:
        local = [g for g in grants if g.grant_id in self._local_ids]
        remote = [g for g in grants if g.grant_id not in self._local_ids]
        await self.local.renew(local, lease_s)
        if not remote or self.breaker.is_open or self.redis is None:
            return
        try:
            await asyncio.wait_for(self.redis.renew(remote, lease_s), PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - leases are long; the breaker decides
            log.debug("budget renew on redis failed: %r", exc)
            self.breaker.record_failure()
        else:
            self.breaker.record_success()

    async def aclose(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=PROBE_TIMEOUT_S * 4)
            if self._task.done() and not self._task.cancelled():
                self._task.exception()  # retrieved: a probe error while closing is expected
            self._task = None
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    def remaining_tokens(self) -> dict[str, float]:
        """Tokens left per tenant as last seen by the backend in use (for the metrics)."""
        if self.breaker.is_open or self.redis is None:
            return self.local.remaining_by_tenant()
        return dict(self.redis.remaining)

    # --- background: heartbeats while closed, reconnects while open -----------------------

    def start(self) -> None:
        """Start connecting and heartbeating (needs a running loop; the first call does it)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._first_attempt = asyncio.Event()
            self._startup_deadline_s = asyncio.get_running_loop().time() + STARTUP_WAIT_S
            self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        while not self._closing:
            if self.breaker.is_open:
                await self._reconnect()
                continue
            try:
                await self._heartbeat()
            except Exception as exc:  # noqa: BLE001
                log.debug("budget heartbeat failed: %r", exc)
                self.breaker.record_failure()
            try:
                await asyncio.wait_for(self._wake.wait(), self._config.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _reconnect(self) -> None:
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=0.05, min=0.05, max=self._config.retry_max_s),
            # a client library may turn our cancellation into its own error: stop when closing
            retry=retry_if_exception(lambda exc: isinstance(exc, Exception) and not self._closing),
            reraise=True)
        async for attempt in retrying:
            with attempt:
                try:
                    await self._probe()
                except Exception as exc:
                    if not isinstance(exc, (asyncio.TimeoutError, RedisTimeoutError)):
                        self._first_attempt.set()  # refused, not slow: no point waiting
                    raise
                self._first_attempt.set()

    async def _probe(self) -> None:
        if self.redis is None:
            client = await connect(self._url, self._config.redis_timeout_s)
            self.redis = RedisStore(client, self._limits_for,
                                    settle_delay_s=self._config.settle_delay_s,
                                    on_reclaim=self._reclaimed, on_rtt=self._rtt)
        await asyncio.wait_for(self.redis.scripts.load(self.redis.client), PROBE_TIMEOUT_S)
        await asyncio.wait_for(self.redis.warm(), PROBE_TIMEOUT_S)
        await self._heartbeat()
        await asyncio.wait_for(self.redis.flush(), PROBE_TIMEOUT_S)
        self.breaker.close()

    async def _heartbeat(self) -> None:
        ttl_ms = int(self._config.heartbeat_s * 3000)
        reply = await asyncio.wait_for(
            self.redis.scripts.call(self.redis.client, "heartbeat", [LIVE_GUARDS_KEY],
                                    [self.instance_id, ttl_ms]), PROBE_TIMEOUT_S)
        self.live_guards = max(1, int(reply))
        if self._metrics is not None:
            self._metrics.live_guards.set(self.live_guards)

    def _on_breaker(self, is_open: bool) -> None:
        if is_open:
            self._seed_local_share()
            log.warning("budget backend: redis -> local share (1/%d of each limit) after %d "
                        "failures", self.live_guards, self._config.breaker_failures)
            if self._wake is not None:
                self._wake.set()
        else:
            log.warning("budget backend: local -> redis (%s)", self._url)
        if self._metrics is not None:
            self._metrics.set_breaker(is_open)

    def _seed_local_share(self) -> None:
        """Start each tenant's local share from its share of what Redis last said was left, so
        an outage never hands out budget the shared bucket had already spent."""
        if self.redis is None:
            return
        n = self.live_guards
        for tenant, (tokens, requests) in self.redis.levels.items():
            self.local.cap_levels(tenant, None if tokens is None else tokens / n,
                                  None if requests is None else requests / n)

    def _local_limits(self, tenant: str) -> BudgetLimits:
        key = f"{self.live_guards}:{tenant}"
        limits = self._shares.get(key)
        if limits is None:
            if len(self._shares) > 10_000:
                self._shares.clear()
            limits = self._shares[key] = _share(self._limits_for(tenant), self.live_guards)
        return limits

    def _reclaimed(self, count: int) -> None:
        if self._metrics is not None:
            self._metrics.reclaimed.inc(count)

    def _rtt(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.rtt.observe(seconds)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "live_guards": self.live_guards,
                "instance_id": self.instance_id}
