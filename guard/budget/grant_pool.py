"""Grants reserved ahead, far from a tenant's limit: most decisions without a Redis round trip.

Far from the limit a Redis decision is a formality (it grants), yet every request waits a round
trip for it. When a tenant's bucket, as Redis last reported it, holds far more than this guard
could take ahead — ``MARGIN`` × the pool's target × the tokens per grant × the live guards, on
each limited axis — a batch sent to Redis carries, after its real requests, extra reserves of
1.5 × the batch's largest size (refunded at settle) up to the pool's target: ``BATCHES_AHEAD`` × the largest batch of the tenant's real
requests seen (``MIN_POOL``..``MAX_POOL``), so a top-up (sent once a quarter is gone) lands
before it runs dry. Those are ordinary grants in Redis (tokens and a request
debited, a lease, reclaimed if this guard dies), held here: a later request of the tenant that
fits one takes it at once (:meth:`GrantPool.take`) and settles it as any grant (Redis refunds
what it did not use). So nothing is ever admitted that Redis did not grant — over-admission
stays 0, and a crash reclaims exactly what it would have.

Held grants go back (released: tokens and request refunded) as soon as they are not needed:
after ``HOLD_S`` unused, when a reply shows the tenant nearing its limit, and at close. While
Redis is unusable they are still Redis's grants: the guard admits from them first (up to a
third of their lease old, so a holder renews them in time), then from its local share, which
starts from what Redis last reported left — the held grants already taken out of it. Near the limit no grant is reserved ahead, so every decision there is
Redis's own, in arrival order. Tenants with ``max_concurrent`` never pool (a held grant holds a
slot). While a grant is held, its tokens are missing from what every guard sees left: at most
``MAX_POOL`` grants for ``HOLD_S``, and only while the bucket holds ``MARGIN`` times that much.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from guard.budget.store import BudgetLimits

__all__ = ["GrantPool", "BATCHES_AHEAD", "MAX_POOL", "MIN_POOL", "HOLD_S", "MARGIN"]

MAX_POOL = 128  # grants held ahead per tenant at most
MIN_POOL = 4  # the smallest pool worth a call
BATCHES_AHEAD = 8  # a pool's target: this many of the tenant's largest batch
HOLD_S = 1.0  # an unused held grant goes back after this
MARGIN = 8  # pool only while the bucket holds this many times what all guards could hold


class GrantPool:
    """Per tenant: held grants ``(grant_id, tokens, reserved_s, max_age_s)``, oldest first."""

    def __init__(self, clock: Callable[[], float], live_guards: Callable[[], int]) -> None:
        self._clock = clock
        self._live_guards = live_guards
        self._held: dict[str, deque[tuple[str, int, float, float]]] = {}
        self._target: dict[str, int] = {}  # tenant -> grants to hold (its largest batch × 8)
        self.stale: list[tuple[str, str]] = []  # (tenant, grant) found expired by take()
        self.num_taken = 0  # requests answered from the pool
        self.num_reserved = 0  # grants reserved ahead (granted by Redis)

    def take(self, tenant: str, tokens: int, max_age_s: float = HOLD_S) -> tuple[str, int] | None:
        """A held grant of at least ``tokens`` (its id and size), or None. Held grants found
        older than ``max_age_s`` (or a third of their own lease: a holder must renew it in
        time) on the way are moved to :attr:`stale` (to be released)."""
        held = self._held.get(tenant)
        if not held:
            return None
        now_s = self._clock()
        while held:
            first = held[0]
            age_s = now_s - first[2]
            if age_s < max_age_s and age_s < first[3]:  # not past min(max_age_s, its own)
                break
            self.stale.append((tenant, held.popleft()[0]))
        else:
            return None  # none left: Redis decides
        if first[1] < tokens:  # too small: Redis decides
            return None
        held.popleft()
        self.num_taken += 1
        return first[0], first[1]

    def held_amount(self, tenant: str) -> tuple[int, int]:
        """Tokens and requests held for ``tenant`` (taken out of Redis's levels, still ours)."""
        held = self._held.get(tenant)
        return (sum(s for _, s, _, _ in held), len(held)) if held else (0, 0)

    def num_held(self, tenant: str) -> int:
        held = self._held.get(tenant)
        return len(held) if held else 0

    def saw_batch(self, tenant: str, num_requests: int) -> None:
        """A batch of ``num_requests`` real requests went to Redis: hold ``BATCHES_AHEAD``
        times that (a top-up, sent at three quarters, lands before the pool runs dry), within
        ``MIN_POOL``..``MAX_POOL``."""
        target = max(self._target.get(tenant, 0), MIN_POOL, BATCHES_AHEAD * num_requests)
        self._target[tenant] = min(MAX_POOL, target)

    def low(self, tenant: str) -> bool:
        """Under three quarters of its target: time to top up (two batches of slack)."""
        held = self._held.get(tenant)
        return (len(held) if held else 0) < self._target.get(tenant, 0) * 3 // 4

    def wanted(self, tenant: str, limits: BudgetLimits,
               levels: tuple[float | None, float | None] | None, size: int) -> int:
        """How many grants of ``size`` tokens to reserve ahead now (0: not far from the limit,
        the tenant's levels never seen, or a concurrency limit)."""
        target = self._target.get(tenant, 0)
        if not target or not self._room(limits, levels, size, target):
            return 0
        return max(0, target - self.num_held(tenant))

    def far_from_limit(self, tenant: str, limits: BudgetLimits,
                       levels: tuple[float | None, float | None] | None) -> bool:
        """Whether the tenant still qualifies for a full pool of its held grants' size (else
        they should go back now)."""
        held = self._held.get(tenant)
        size = max((s for _, s, _, _ in held), default=1) if held else 1
        return self._room(limits, levels, size, self._target.get(tenant, MIN_POOL))

    def _room(self, limits: BudgetLimits, levels: tuple[float | None, float | None] | None,
              size: int, target: int) -> bool:
        if limits.max_concurrent is not None or levels is None or size < 1:
            return False
        if limits.tokens_per_minute is None and limits.requests_per_minute is None:
            return False  # nothing to decide ahead: unlimited on both rate axes
        hold_all = MARGIN * target * max(1, self._live_guards())
        tokens_left, requests_left = levels
        if limits.tokens_per_minute is not None and (tokens_left is None
                                                     or tokens_left < hold_all * size):
            return False
        return limits.requests_per_minute is None or (requests_left is not None
                                                      and requests_left >= hold_all)

    def add(self, tenant: str, grant_id: str, tokens: int, lease_s: float) -> None:
        """A grant Redis made ahead, of ``tokens`` on a lease of ``lease_s``."""
        self.add_many(tenant, (grant_id,), tokens, lease_s)

    def add_many(self, tenant: str, grant_ids: Iterable[str], tokens: int,
                 lease_s: float) -> None:
        """Grants Redis made ahead in one call, each of ``tokens`` on a lease of ``lease_s``."""
        now_s, max_age_s = self._clock(), lease_s / 3
        entries = [(grant_id, tokens, now_s, max_age_s) for grant_id in grant_ids]
        if not entries:
            return
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = deque()
        held.extend(entries)
        self.num_reserved += len(entries)

    def drain(self, tenant: str) -> list[str]:
        """Every grant held for ``tenant``, removed (to be released)."""
        self._target.pop(tenant, None)  # start small again
        held = self._held.pop(tenant, None)
        return [entry[0] for entry in held] if held else []

    def expired(self) -> dict[str, list[str]]:
        """Held grants past ``HOLD_S``, removed, by tenant (to be released)."""
        now_s = self._clock()
        out: dict[str, list[str]] = {}
        for tenant, held in list(self._held.items()):
            while held and now_s - held[0][2] >= min(HOLD_S, held[0][3]):
                out.setdefault(tenant, []).append(held.popleft()[0])
            if not held:
                del self._held[tenant]
        return out

    def tenants(self) -> list[str]:
        return list(self._held)
