"""The budget store contract: reserve → settle | release, with leases renewed by the holder.

The admission controller talks to a store only through this protocol, so the in-memory store
(the embedded default) and the Redis store (shared by several guards) are interchangeable and
pass one contract test suite.

Flow per admitted request::

    outcome = await store.reserve(tenant, tokens, lease_s)   # prompt + priced max_tokens
    Denied  -> 429 with outcome.reason; wait advised only when outcome.retry_after_s is not None
    Grant   -> ... request runs; the holder renews its leases every lease_s / 3 ...
            -> await store.settle(grant, used_tokens)   # completed: charge what was used
            -> await store.release(grant)               # canceled / failed / never dispatched

``settle`` and ``release`` are idempotent per grant and never raise on store trouble (a store
that cannot reach its backend logs, counts, and lets the lease expire).

Two optional methods let a caller skip the awaiting where a store does not need it (the guard's
:class:`~guard.admission.budget_grants.BudgetGrants` uses them when present)::

    store.reserve_now(tenant, tokens, lease_s) -> Grant | Denied  # decided without awaiting
    store.finish_soon(grant, used_tokens | None)  # settle (or release: None) without awaiting;
                                                   # queued where the backend is remote

A third, ``store.remaining_now(tenant) -> (tokens, requests) | None``, says how much of each
per-minute budget the tenant has left now (None on an unlimited axis; None for both: not known
yet), for the ``x-ratelimit-remaining-*`` headers; every kvguard store has it.

The in-memory store has both; the Redis and fallback stores have ``finish_soon``, and a
``reserve_now`` that answers only with a grant Redis reserved ahead (far from the tenant's
limit: :mod:`guard.budget.grant_pool`) and returns None when Redis must decide (await
``reserve``). A store with
a remote backend may also have ``await store.open()``: connect at the guard's start-up and
return once the first contact attempt ended (the controller's start calls it; the fallback
store has it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["BudgetLimits", "BudgetStore", "Denied", "Grant", "DENY_REASONS"]

DENY_REASONS = ("tpm_limit", "rpm_limit", "concurrency_limit")


@dataclass(frozen=True)
class BudgetLimits:
    """One tenant's limits; ``None`` means unlimited on that axis."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_minute", "requests_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"budget {name}: must be an integer >= 1 or absent, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return (self.tokens_per_minute is None and self.requests_per_minute is None
                and self.max_concurrent is None)


@dataclass(frozen=True)
class Grant:
    """A held reservation: ``tokens`` charged up front, one request and one slot."""

    tenant: str
    grant_id: str
    tokens: int


@dataclass(frozen=True)
class Denied:
    """Not now. ``retry_after_s`` None means never (the request can never fit the limit)."""

    reason: str
    retry_after_s: float | None


class BudgetStore(Protocol):
    async def reserve(self, tenant: str, tokens: int, lease_s: float) -> Grant | Denied: ...

    async def settle(self, grant: Grant, used_tokens: int) -> None: ...

    async def release(self, grant: Grant) -> None: ...

    async def renew(self, grants: Sequence[Grant], lease_s: float) -> None: ...

    async def aclose(self) -> None: ...
