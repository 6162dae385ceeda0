"""Redis budgets that survive Redis: a breaker, a local share, and a background reconnect.

:class:`FallbackStore` is what a guard with a ``redis_url`` uses. While Redis answers, every
reserve is one script call bounded by ``redis_timeout_s``. After ``breaker_failures``
consecutive failures (a timeout, a refused connection, a hung server) the breaker opens and the
guard enforces a **local share** of each limit (:mod:`guard.budget.local_share`): the limit
divided by the number of guards seen live in Redis over the last ``LIVE_WINDOW_BEATS`` heartbeats
(each guard heartbeats every ``heartbeat_s``; the largest recent count, so a late heartbeat
never inflates the shares), starting from this guard's share of what Redis last reported left
— an outage never re-grants budget the shared bucket had already spent. A single failed call
while the breaker is still closed is decided on that share too. Heartbeats also refresh the
levels of tenants this guard has not heard about for a beat, so its last view stays recent.

A background task reconnects on a tenacity backoff (capped at ``retry_max_s``), reloads the
scripts, charges Redis with what was admitted locally (once: net of refunds, or the guard's debt
when Redis lost its state — see :mod:`guard.budget.local_share`), and closes the breaker.

**Start-up.** The link is opened when the guard starts (:meth:`FallbackStore.open`, called by
the controller's start: the ASGI lifespan of the middleware and of ``kvguard proxy``), not by
the first request, and start-up waits — once, at most ``STARTUP_WAIT_S`` — until Redis answered
or refused. A refused connection (Redis absent) ends the wait at once and the guard starts in
local mode, retrying in the background: Redis never blocks or crash-loops a start. Until this
guard has reached Redis once it has seen no heartbeat, so it cannot know how many guards share
a budget; it then decides on a **start-up share**: each limit ÷ ``budget.expected_guards``
(default 3; an operator sets it to the number of guards they run), never the whole limit. So a
fleet that starts while Redis is absent, slow or hung admits at most one budget across
``expected_guards`` guards (LiteLLM's per-pod full limit on a Redis error is the failure this
avoids), and a guard that starts late beside guards already on Redis adds at most
``limit ÷ expected_guards`` before its first contact. At that contact it charges Redis with
exactly what it admitted locally (net of refunds: the full share it started from was not seeded
from Redis, so nothing of it is owed twice) before deciding anything there. Requests that arrive
before the start-up wait ended (a server without a lifespan) wait for it the same way.

Grants remember where they were made: a local grant is settled locally (a refund after its
episode was charged goes to Redis); a Redis grant whose settle cannot be delivered is retried,
and if that is lost too, its lease expires and Redis reclaims it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, retry_if_exception, wait_exponential

from guard.budget.breaker import Breaker
from guard.budget.config import BudgetConfig
from guard.budget.connection import connect
from guard.budget.keys import EPOCH_KEY, LIVE_GUARDS_KEY
from guard.budget.local_share import LocalShare
from guard.budget.memory_store import check_reserve_args
from guard.budget.metrics import BudgetMetrics
from guard.budget.redis_store import RedisStore
from guard.budget.store import BudgetLimits, Denied, Grant
from guard.redact import redact_url

__all__ = ["FallbackStore"]

log = logging.getLogger("kvguard.budget")
PROBE_TIMEOUT_S = 0.5  # reconnect probes (not on the request path) may wait this long
STARTUP_WAIT_S = 1.0  # the first requests wait this long, once, for the first connect attempt
LIVE_WINDOW_BEATS = 10  # the local share divides by the most guards seen live in this many beats
MAX_REFRESH_PER_BEAT = 32  # tenants whose levels one heartbeat reads again
EPOCH_TTL_S = 3600.0  # the epoch key outlives every guard by this much


class FallbackStore:
    """:class:`~guard.budget.store.BudgetStore` on Redis with a local-share fallback."""

    def __init__(self, url: str, limits_for: Callable[[str], BudgetLimits], config: BudgetConfig,
                 clock: Callable[[], float], metrics: BudgetMetrics | None = None,
                 instance_id: str | None = None) -> None:
        self._url = url
        self._shown_url = redact_url(url)  # what the log lines name
        self._limits_for = limits_for
        self._config = config
        self._metrics = metrics
        self.instance_id = instance_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.breaker = Breaker(config.breaker_failures, self._on_breaker)
        self.breaker.is_open = True  # until the first connect succeeds (start-up: local share)
        self.share = LocalShare(limits_for, clock, on_reclaim=self._reclaimed)
        self.share.live_guards = config.expected_guards  # the start-up share, until a heartbeat
        self.ever_reached = False  # reached Redis once (False: decisions on the start-up share)
        self.local = self.share.store
        self.redis: RedisStore | None = None
        self.epoch: str | None = None  # Redis's epoch as last seen (a new one: state lost)
        self._live_counts: deque[int] = deque(maxlen=LIVE_WINDOW_BEATS)
        self.num_local_reserves = 0  # reserves decided on the local share (Redis unusable)
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._first_attempt: asyncio.Event | None = None  # set once the first probe has ended
        self._startup_deadline_s = 0.0  # loop time after which requests stop waiting for it
        if metrics is not None:
            metrics.watch_remaining(self.remaining_tokens, self.remaining_requests)

    @property
    def live_guards(self) -> int:
        return self.share.live_guards

    @property
    def backend(self) -> str:
        return "local" if self.breaker.is_open else "redis"

    async def reserve(self, tenant: str, tokens: int, lease_s: float) -> Grant | Denied:
        check_reserve_args(tenant, tokens, lease_s)
        self._ensure_started()
        if not self._first_attempt.is_set():  # start-up: a local grant now would be on top of
            await self._await_first_attempt()  # the shared budget, so give Redis a moment
        held = self._from_pool(tenant, tokens, lease_s)
        if held is not None:
            return held
        if not self.breaker.is_open and self.redis is not None:
            try:  # bounded by redis_timeout_s (one timer per batch, in the Redis store)
                outcome = await self.redis.reserve(tenant, tokens, lease_s)
            except Exception as exc:  # noqa: BLE001 - any Redis trouble: serve locally
                log.debug("budget reserve on redis failed: %r", exc)
                self.breaker.record_failure()
            else:
                self.breaker.record_success()
                if self.share.in_episode:  # back on Redis after a failed call or two
                    self._end_episode()
                return outcome
        self.num_local_reserves += 1
        redis = self.redis
        return self.share.reserve(tenant, tokens, lease_s, self.epoch,
                                  redis.levels.get(tenant) if redis is not None else None,
                                  redis.pending_charge(tenant) if redis is not None else (0.0, 0.0))

    def reserve_now(self, tenant: str, tokens: int, lease_s: float) -> Grant | None:
        """A grant Redis reserved ahead for the tenant (far from its limit: see
        :mod:`guard.budget.grant_pool`), without awaiting; None: await :meth:`reserve`."""
        check_reserve_args(tenant, tokens, lease_s)
        redis = self.redis
        if redis is not None and not self.breaker.is_open:  # _from_pool(), the common case
            return redis.take_held(tenant, tokens)
        return self._from_pool(tenant, tokens, lease_s)

    def _from_pool(self, tenant: str, tokens: int, lease_s: float) -> Grant | None:
        """A held grant; while Redis is unusable, one up to a third of its lease old (Redis
        still counts it; its holder renews it within a third of a lease) and no top-up."""
        redis = self.redis
        if redis is None:
            return None
        if self.breaker.is_open:
            return redis.take_held(tenant, tokens, top_up=False,
                                   max_age_s=self._config.lease_s / 3)
        return redis.take_held(tenant, tokens)

    async def open(self) -> None:
        """Start the link and wait until the first contact attempt ended: Redis answered or
        refused, or ``STARTUP_WAIT_S`` passed (a hung or slow Redis). Never raises for Redis."""
        self._ensure_started()
        if not self._first_attempt.is_set():
            await self._await_first_attempt()
        if not self.ever_reached:
            log.warning("budget backend: redis %s not reached at start-up; deciding on a "
                        "start-up share (1/%d of each limit, budget.expected_guards) and "
                        "retrying in the background", self._shown_url, self.live_guards)

    async def _await_first_attempt(self) -> None:
        """Wait until Redis answered or refused, but never past the start-up window."""
        left_s = self._startup_deadline_s - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._first_attempt.wait(), max(0.0, left_s))
        except asyncio.TimeoutError:
            self._first_attempt.set()  # a hung Redis at start-up: local share from now on

    async def settle(self, grant: Grant, used_tokens: int) -> None:
        if self.share.is_local(grant):
            self._give_back(grant.tenant, self.share.finish(grant, used_tokens))
        elif self.redis is not None:
            await self.redis.settle(grant, used_tokens)

    async def release(self, grant: Grant) -> None:
        if self.share.is_local(grant):
            self._give_back(grant.tenant, self.share.finish(grant, None))
        elif self.redis is not None:
            await self.redis.release(grant)

    def finish_soon(self, grant: Grant, used_tokens: int | None) -> None:
        """Settle (``used_tokens``) or release (None) without awaiting (see the Redis store's)."""
        if self.share.is_local(grant):
            self._give_back(grant.tenant, self.share.finish(grant, used_tokens))
        elif self.redis is not None:
            self.redis.finish_soon(grant, used_tokens)

    def _give_back(self, tenant: str, refund: tuple[float, float]) -> None:
        """A local grant's refund after its episode was charged to Redis: Redis gets it."""
        if self.redis is not None and (refund[0] or refund[1]):
            self.redis.charge(tenant, -refund[0], -refund[1])

    async def renew(self, grants: Sequence[Grant], lease_s: float) -> None:
        local = [g for g in grants if self.share.is_local(g)]
        remote = [g for g in grants if not self.share.is_local(g)]
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

    def remaining_now(self, tenant: str) -> tuple[float | None, float | None] | None:
        """(tokens, requests) the tenant has left as the backend in use sees it (the local
        share's own while Redis is unusable); None on an unlimited axis, or None: not known."""
        if self.breaker.is_open or self.redis is None:
            return self.local.remaining_now(tenant)
        return self.redis.remaining_now(tenant)

    def remaining_tokens(self) -> dict[str, float]:
        """Tokens left per tenant as last seen by the backend in use (for the metrics)."""
        if self.breaker.is_open or self.redis is None:
            return self.local.remaining_by_tenant()
        pool = self.redis.pool  # grants held ahead are still this guard's to give
        return {t: r + pool.held_amount(t)[0] for t, r in list(self.redis.remaining.items())}

    def remaining_requests(self) -> dict[str, float]:
        """Requests left per tenant as last seen by the backend in use (for the metrics)."""
        if self.breaker.is_open or self.redis is None:
            return self.local.remaining_requests_by_tenant()
        pool = self.redis.pool
        return {t: r + pool.held_amount(t)[1] for t, (_, r) in list(self.redis.levels.items())
                if r is not None}

    # --- background: heartbeats while closed, reconnects while open -----------------------

    def start(self) -> None:
        """Start connecting and heartbeating without waiting (needs a running loop; see
        :meth:`open`)."""
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
            self.redis.release_expired()  # grants held ahead and not used: back to Redis
            try:
                await self._heartbeat()
                if self.share.in_episode:  # local decisions while the breaker stayed closed
                    self._end_episode()
            except Exception as exc:  # noqa: BLE001
                log.debug("budget heartbeat failed: %r", exc)
                self.breaker.record_failure()
            else:
                await self._refresh_levels()
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
                                    on_reclaim=self._reclaimed, on_rtt=self._rtt,
                                    reserve_timeout_s=self._config.redis_timeout_s,
                                    reserve_ahead=self._config.reserve_ahead,
                                    live_guards=lambda: self.live_guards)
        await asyncio.wait_for(self.redis.scripts.load(self.redis.client), PROBE_TIMEOUT_S)
        await asyncio.wait_for(self.redis.warm(), PROBE_TIMEOUT_S)
        await self._heartbeat()
        self._end_episode()
        if not await asyncio.wait_for(self.redis.flush(), PROBE_TIMEOUT_S):
            raise ConnectionError("budget charges not delivered")  # stay local, retry
        self.ever_reached = True
        self.breaker.close()

    async def _heartbeat(self) -> None:
        ttl_ms = int(self._config.heartbeat_s * 3000)
        reply = await asyncio.wait_for(
            self.redis.scripts.call(self.redis.client, "heartbeat", [LIVE_GUARDS_KEY, EPOCH_KEY],
                                    [self.instance_id, ttl_ms, uuid.uuid4().hex,
                                     int(EPOCH_TTL_S * 1000)]), PROBE_TIMEOUT_S)
        self._live_counts.append(max(1, int(reply[0])))
        self.share.live_guards = max(self._live_counts)
        epoch = str(reply[1])
        if self.epoch is not None and epoch != self.epoch:
            self._on_state_lost()
        self.epoch = epoch
        if self._metrics is not None:
            self._metrics.live_guards.set(self.live_guards)

    def _on_state_lost(self) -> None:
        """Redis came back empty (a new epoch): its buckets are full again. Charge each tenant
        this guard knew, outside a local episode, its share of what had been spent (episodes
        pay their own debt when they end)."""
        log.warning("budget backend: redis lost its state (new epoch); re-charging what had "
                    "been spent")
        episode = self.share.tenants()
        n = self.live_guards
        for tenant, (tokens_left, requests_left) in list(self.redis.levels.items()):
            if tenant in episode:
                continue
            limits = self._limits_for(tenant)
            self.redis.charge(
                tenant,
                0.0 if tokens_left is None else max(0.0, limits.tokens_per_minute - tokens_left) / n,
                0.0 if requests_left is None else
                max(0.0, limits.requests_per_minute - requests_left) / n)
        self.redis.release_held()  # grants held ahead were in the lost state
        self.redis.forget_levels()

    def _end_episode(self) -> None:
        """Charge Redis with this guard's local decisions (see :mod:`guard.budget.local_share`)."""
        for tenant, (tokens, requests) in self.share.end(self.epoch).items():
            self.redis.charge(tenant, tokens, requests)

    async def _refresh_levels(self) -> None:
        """Read again the levels of tenants this guard has not heard about for a beat (best
        effort: a slow answer here is no reason to leave Redis; the heartbeat decides)."""
        try:
            await asyncio.wait_for(self.redis.refresh(self._stale_tenants()), PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            log.debug("budget level refresh incomplete: %r", exc)

    def _stale_tenants(self) -> list[str]:
        """Tenants whose levels this guard has not refreshed for a beat (most recent first)."""
        horizon_s = time.monotonic() - self._config.heartbeat_s
        seen = sorted(((s, t) for t, s in list(self.redis.seen_s.items()) if s < horizon_s),
                      reverse=True)
        return [t for _, t in seen[:MAX_REFRESH_PER_BEAT]]

    def _on_breaker(self, is_open: bool) -> None:
        if is_open:
            log.warning("budget backend: redis -> local share (1/%d of each limit) after %d "
                        "failures", self.live_guards, self._config.breaker_failures)
            if self._wake is not None:
                self._wake.set()
        else:
            log.info("budget backend: local -> redis (%s)", self._shown_url)  # back to normal
        if self._metrics is not None:
            self._metrics.set_breaker(is_open)

    def _reclaimed(self, count: int) -> None:
        if self._metrics is not None:
            self._metrics.reclaimed.inc(count)

    def _rtt(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.rtt.observe(seconds)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "live_guards": self.live_guards,
                "instance_id": self.instance_id}
