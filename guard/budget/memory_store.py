"""The in-memory budget store: one process's token buckets and leases (the embedded default).

Same semantics as the Redis store, to the token: per tenant a token bucket of
``tokens_per_minute`` and one of ``requests_per_minute`` (each refills linearly from empty to
full in one minute, so there is no fixed-window edge), and a set of leases (one per grant, one
in-flight slot each, ``max_concurrent`` of them at most). A lease that is not renewed before it
expires is reclaimed on the tenant's next operation: its tokens and its request are refunded.

Also the local share a guard falls back on when Redis is unreachable (limits divided by the
number of live guards: pass such a ``limits_for``).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from guard.budget.store import BudgetLimits, Denied, Grant

__all__ = ["MemoryStore", "REFILL_S", "check_reserve_args"]

REFILL_S = 60.0  # limits are per minute: an empty bucket is full again after one minute
MAX_CONCURRENT_RETRY_S = 1.0  # a full slot set advises a retry no later than this


def check_reserve_args(tenant: str, tokens: int, lease_s: float) -> None:
    """ValueError for arguments no store accepts (nothing is charged)."""
    if (tenant.__class__ is str and tenant and tokens.__class__ is int and tokens >= 1
            and lease_s.__class__ is float and lease_s > 0):
        return  # what the guard passes (exact types): the checks below, without their calls
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"budget reserve: tenant must be a non-empty string, got {tenant!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"budget reserve: tokens must be an integer >= 1, got {tokens!r}")
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s > 0:
        raise ValueError(f"budget reserve: lease_s must be a number > 0, got {lease_s!r}")


def _refill(level: float | None, limit: int | None, elapsed_s: float) -> float:
    """One axis refilled over ``elapsed_s``: ``min(limit, level + elapsed × limit / REFILL_S)``,
    full when never drawn (None), 0 when unlimited."""
    if limit is None:
        return 0.0
    if level is None:
        return float(limit)
    level += elapsed_s * limit / REFILL_S
    return level if level < limit else float(limit)


def _levels_at(state: _Tenant, tpm: int | None, rpm: int | None,
               now_s: float) -> tuple[float, float]:
    """The tenant's (tokens, requests) buckets refilled to ``now_s``."""
    elapsed_s = now_s - state.stamp_s
    return (_refill(state.tokens_level, tpm, elapsed_s),
            _refill(state.requests_level, rpm, elapsed_s))


def _clamp(value: float, cap: int | None) -> float:
    return 0.0 if cap is None else max(-float(cap), min(float(cap), value))


@dataclass
class _Tenant:
    tokens_level: float | None = None  # None: full
    requests_level: float | None = None
    stamp_s: float = 0.0
    leases: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (tokens, expiry)
    first_expiry_s: float = math.inf  # no lease expires before this (a lower bound)


class MemoryStore:
    """In-process :class:`~guard.budget.store.BudgetStore`. ``clock`` returns seconds."""

    def __init__(self, limits_for: Callable[[str], BudgetLimits], clock: Callable[[], float],
                 on_reclaim: Callable[[int], None] | None = None) -> None:
        self._limits_for = limits_for
        self._clock = clock
        self._on_reclaim = on_reclaim
        self._tenants: dict[str, _Tenant] = {}
        self._id_prefix = f"m{os.urandom(4).hex()}-"
        self._next_id = itertools.count(1)

    async def reserve(self, tenant: str, tokens: int, lease_s: float) -> Grant | Denied:
        return self.reserve_now(tenant, tokens, lease_s)

    def reserve_now(self, tenant: str, tokens: int, lease_s: float,
                    grant_id: str | None = None) -> Grant | Denied:
        """:meth:`reserve` without awaiting (the fallback store calls it on the request path)."""
        check_reserve_args(tenant, tokens, lease_s)
        limits = self._limits_for(tenant)
        now_s = self._clock()
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(stamp_s=now_s)
        tpm, rpm = limits.tokens_per_minute, limits.requests_per_minute
        levels = _levels_at(state, tpm, rpm, now_s)
        if now_s >= state.first_expiry_s:  # a lease may have expired: reclaim it first
            levels = self._reap(state, levels, limits, now_s)
        tokens_level, requests_level = levels
        max_concurrent = limits.max_concurrent
        if ((max_concurrent is None or len(state.leases) < max_concurrent)
                and (rpm is None or requests_level >= 1)
                and (tpm is None or (tokens <= tpm and tokens_level >= tokens))):
            # granted (what _check() would find): both levels stay within [0, limit], so the
            # clamps are no-ops; an unlimited axis stays 0
            expiry_s = now_s + lease_s
            grant_id = grant_id or f"{self._id_prefix}{next(self._next_id)}"
            state.leases[grant_id] = (tokens, expiry_s)
            if expiry_s < state.first_expiry_s:
                state.first_expiry_s = expiry_s
            state.tokens_level = 0.0 if tpm is None else tokens_level - tokens
            state.requests_level = 0.0 if rpm is None else requests_level - 1
            state.stamp_s = now_s
            return Grant(tenant, grant_id, tokens)
        denied = self._check(state, levels, limits, tokens, now_s)
        self._store(state, levels, now_s)
        return denied

    async def settle(self, grant: Grant, used_tokens: int) -> None:
        self.finish_soon(grant, used_tokens)

    async def release(self, grant: Grant) -> None:
        self.finish_soon(grant, None)

    def finish_soon(self, grant: Grant, used_tokens: int | None) -> None:
        """Settle (``used_tokens``) or release (None) now, without awaiting."""
        self._finish(grant, None if used_tokens is None else max(0, int(used_tokens)))

    async def renew(self, grants: Sequence[Grant], lease_s: float) -> None:
        now_s = self._clock()
        for grant in grants:
            state = self._tenants.get(grant.tenant)
            held = state.leases.get(grant.grant_id) if state else None
            if held is not None and held[1] > now_s:
                state.leases[grant.grant_id] = (held[0], now_s + lease_s)

    async def aclose(self) -> None:
        return None

    # --- introspection (tests, metrics) ---------------------------------------------------

    def remaining_tokens(self, tenant: str) -> float | None:
        """Tokens the tenant could reserve now (None: no token limit)."""
        limits = self._limits_for(tenant)
        if limits.tokens_per_minute is None:
            return None
        state = self._tenants.get(tenant)
        if state is None:
            return float(limits.tokens_per_minute)
        return self._levels(state, limits, self._clock())[0]

    def remaining_now(self, tenant: str) -> tuple[float | None, float | None]:
        """(tokens, requests) the tenant could reserve now; None on an unlimited axis."""
        limits = self._limits_for(tenant)
        tokens, requests = self.levels_now(tenant)
        return (None if limits.tokens_per_minute is None else tokens,
                None if limits.requests_per_minute is None else requests)

    def set_levels(self, tenant: str, tokens: float | None, requests: float | None) -> None:
        """Set the tenant's buckets to ``tokens`` / ``requests`` now, clamped to ±limit (None or
        an unlimited axis: left as it is). Leases are kept."""
        limits = self._limits_for(tenant)
        now_s = self._clock()
        state = self._tenants.setdefault(tenant, _Tenant(stamp_s=now_s))
        tokens_level, requests_level = self._levels(state, limits, now_s)
        if tokens is not None and limits.tokens_per_minute is not None:
            tokens_level = _clamp(tokens, limits.tokens_per_minute)
        if requests is not None and limits.requests_per_minute is not None:
            requests_level = _clamp(requests, limits.requests_per_minute)
        self._store(state, (tokens_level, requests_level), now_s)

    def levels_now(self, tenant: str) -> tuple[float, float]:
        """The tenant's (tokens, requests) buckets now (0 on an unlimited axis)."""
        limits = self._limits_for(tenant)
        state = self._tenants.get(tenant)
        if state is None:
            return (float(limits.tokens_per_minute or 0), float(limits.requests_per_minute or 0))
        return self._levels(state, limits, self._clock())

    def remaining_by_tenant(self) -> dict[str, float]:
        """Tokens left for every tenant seen so far that has a token limit."""
        out = {}
        for tenant in self._tenants:
            remaining = self.remaining_tokens(tenant)
            if remaining is not None:
                out[tenant] = remaining
        return out

    def remaining_requests_by_tenant(self) -> dict[str, float]:
        """Requests left for every tenant seen so far that has a requests-per-minute limit."""
        return {tenant: self.levels_now(tenant)[1] for tenant in self._tenants
                if self._limits_for(tenant).requests_per_minute is not None}

    def num_leases(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return len(state.leases) if state else 0

    # --- internals ------------------------------------------------------------------------

    @staticmethod
    def _levels(state: _Tenant, limits: BudgetLimits, now_s: float) -> tuple[float, float]:
        return _levels_at(state, limits.tokens_per_minute, limits.requests_per_minute, now_s)

    @staticmethod
    def _store(state: _Tenant, levels: tuple[float, float], now_s: float) -> None:
        state.tokens_level, state.requests_level = levels
        state.stamp_s = now_s

    def _reap(self, state: _Tenant, levels: tuple[float, float], limits: BudgetLimits,
              now_s: float) -> tuple[float, float]:
        if now_s < state.first_expiry_s:
            return levels
        expired = [gid for gid, (_, expiry_s) in state.leases.items() if expiry_s <= now_s]
        tokens_level, requests_level = levels
        for gid in expired:
            tokens, _ = state.leases.pop(gid)
            tokens_level = _clamp(tokens_level + tokens, limits.tokens_per_minute)
            requests_level = _clamp(requests_level + 1, limits.requests_per_minute)
        state.first_expiry_s = min((e for _, e in state.leases.values()), default=math.inf)
        if expired and self._on_reclaim is not None:
            self._on_reclaim(len(expired))
        return tokens_level, requests_level

    @staticmethod
    def _check(state: _Tenant, levels: tuple[float, float], limits: BudgetLimits, tokens: int,
               now_s: float) -> Denied | None:
        tokens_level, requests_level = levels
        if limits.max_concurrent is not None and len(state.leases) >= limits.max_concurrent:
            first_expiry_s = min(expiry_s for _, expiry_s in state.leases.values())
            wait_s = min(MAX_CONCURRENT_RETRY_S, max(0.001, first_expiry_s - now_s))
            return Denied("concurrency_limit", wait_s)
        rpm = limits.requests_per_minute
        if rpm is not None and requests_level < 1:
            return Denied("rpm_limit", _ceil_ms((1 - requests_level) * REFILL_S / rpm))
        tpm = limits.tokens_per_minute
        if tpm is not None and tokens > tpm:
            return Denied("tpm_limit", None)
        if tpm is not None and tokens_level < tokens:
            return Denied("tpm_limit", _ceil_ms((tokens - tokens_level) * REFILL_S / tpm))
        return None

    def _finish(self, grant: Grant, used_tokens: int | None) -> None:
        state = self._tenants.get(grant.tenant)
        held = state.leases.pop(grant.grant_id, None) if state else None
        if held is None:
            return  # already settled, released or reclaimed: idempotent
        limits = self._limits_for(grant.tenant)
        now_s = self._clock()
        tpm, rpm = limits.tokens_per_minute, limits.requests_per_minute
        tokens_level, requests_level = _levels_at(state, tpm, rpm, now_s)
        refund = held[0] if used_tokens is None else held[0] - used_tokens
        if used_tokens is None:
            requests_level = _clamp(requests_level + 1, rpm)
        self._store(state, (_clamp(tokens_level + refund, tpm), requests_level), now_s)


def _ceil_ms(seconds: float) -> float:
    return math.ceil(seconds * 1000) / 1000
