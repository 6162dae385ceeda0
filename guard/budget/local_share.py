"""A guard's local share of each tenant's budget while Redis is unusable, and what it owes Redis.

While Redis cannot be reached (or one call timed out) a guard decides on its **local share**:
an in-memory bucket of ``limit ÷ live guards`` per axis, refilling at ``rate ÷ live guards``.
A tenant's share does not start full: at the first local decision of an *episode* (a run of
local decisions) it starts from this guard's share of what Redis last reported left for the
tenant (``remaining ÷ live guards``), less anything this guard still owes Redis from an earlier
episode — so an outage at 80 % of a window hands out the remaining 20 %, not a fresh window.
A tenant this guard never saw on Redis starts from a full share. Either way never above what
the local bucket itself holds now: it keeps its level between episodes and refills at the
share's rate, so a guard whose breaker flaps (a slow, not a dead, Redis) cannot start episode
after episode from the same stale report and hand out its share each time.

When the guard is back on Redis the episode ends and each tenant's local decisions are charged
to the shared bucket, exactly once:

- Redis kept its state (same epoch), or the guard had never reached Redis (a start-up share,
  not seeded from Redis): the net tokens and requests admitted locally (reserved less
  refunded), so the shared bucket ends where one bucket would have been.
- Redis lost its state (a restarted server: new epoch, its buckets full again): the guard's
  *debt* — its share's capacity less its local level now — so that once every guard has paid,
  the fresh bucket holds the sum of the local levels, i.e. what was left, not a new window.

Local grants are settled in this store; a refund that comes after its episode was charged is
handed back to Redis (``finish`` returns it), so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from guard.budget.memory_store import MemoryStore
from guard.budget.store import BudgetLimits, Denied, Grant

__all__ = ["LocalShare", "share_of"]

MAX_CACHED_SHARES = 10_000


def share_of(limits: BudgetLimits, num_guards: int) -> BudgetLimits:
    """Each limit divided by ``num_guards`` (at least 1 where limited)."""
    def part(value: int | None) -> int | None:
        return None if value is None else max(1, value // num_guards)
    return BudgetLimits(part(limits.tokens_per_minute), part(limits.requests_per_minute),
                        part(limits.max_concurrent))


@dataclass
class _Episode:
    """One tenant's local decisions since the guard last reached Redis."""

    epoch: str | None  # the Redis epoch the share was seeded under (None: never seen one)
    tokens: float = 0.0  # net admitted locally: reserved less refunded
    requests: float = 0.0
    charged: bool = False  # the episode was charged to Redis: later refunds go there


class LocalShare:
    """The local buckets (a :class:`MemoryStore` on the divided limits) and their episodes."""

    def __init__(self, limits_for: Callable[[str], BudgetLimits], clock: Callable[[], float],
                 on_reclaim: Callable[[int], None] | None = None) -> None:
        self._limits_for = limits_for
        self.live_guards = 1
        self.store = MemoryStore(self.limits, clock, on_reclaim=on_reclaim)
        self._shares: dict[tuple[int, str], BudgetLimits] = {}
        self._episodes: dict[str, _Episode] = {}
        self._grants: dict[str, _Episode] = {}  # local grant id -> the episode that made it

    def limits(self, tenant: str) -> BudgetLimits:
        key = (self.live_guards, tenant)
        limits = self._shares.get(key)
        if limits is None:
            if len(self._shares) > MAX_CACHED_SHARES:
                self._shares.clear()
            limits = self._shares[key] = share_of(self._limits_for(tenant), self.live_guards)
        return limits

    @property
    def in_episode(self) -> bool:
        return bool(self._episodes)

    def tenants(self) -> set[str]:
        return set(self._episodes)

    def reserve(self, tenant: str, tokens: int, lease_s: float, epoch: str | None,
                seen: tuple[float | None, float | None] | None,
                owed: tuple[float, float]) -> Grant | Denied:
        """Decide locally. ``seen``: the (tokens, requests) Redis last reported left for the
        tenant (None: never seen); ``owed``: what this guard has queued for Redis to take."""
        episode = self._episodes.get(tenant)
        if episode is None:
            episode = self._episodes[tenant] = _Episode(epoch)
            self._seed(tenant, seen, owed)
        outcome = self.store.reserve_now(tenant, tokens, lease_s)
        if isinstance(outcome, Grant):
            episode.tokens += tokens
            episode.requests += 1
            self._grants[outcome.grant_id] = episode
        return outcome

    def _seed(self, tenant: str, seen: tuple[float | None, float | None] | None,
              owed: tuple[float, float]) -> None:
        share = self.limits(tenant)
        n = self.live_guards
        # never above what earlier episodes left in the local bucket (it refills at the
        # share's rate): ``seen`` may predate other guards' local grants not yet charged, so a
        # guard whose breaker flaps would otherwise start each episode from the same stale
        # level and hand out its share again and again within one window
        now_levels = self.store.levels_now(tenant)
        levels = []
        for cap, left, own, local_left in (
                (share.tokens_per_minute, seen and seen[0], owed[0], now_levels[0]),
                (share.requests_per_minute, seen and seen[1], owed[1], now_levels[1])):
            start = float(cap or 0) if left is None else left / n
            levels.append(None if cap is None else min(start - own, local_left))
        self.store.set_levels(tenant, levels[0], levels[1])

    def is_local(self, grant: Grant) -> bool:
        return grant.grant_id in self._grants

    def finish(self, grant: Grant, used_tokens: int | None) -> tuple[float, float]:
        """Settle (``used_tokens``) or release (None) a local grant. Returns the (tokens,
        requests) Redis must give back: the refund, when the episode was already charged."""
        episode = self._grants.pop(grant.grant_id)
        if used_tokens is None:
            self.store.finish_soon(grant, None)
            refund = (float(grant.tokens), 1.0)
        else:
            used = max(0, int(used_tokens))
            self.store.finish_soon(grant, used)
            refund = (float(max(0, grant.tokens - used)), 0.0)
        if episode.charged:
            return refund
        episode.tokens -= refund[0]
        episode.requests -= refund[1]
        return 0.0, 0.0

    def end(self, epoch: str | None) -> dict[str, tuple[float, float]]:
        """End every tenant's episode: what each must be charged to Redis under ``epoch``."""
        charges = {}
        for tenant, episode in self._episodes.items():
            episode.charged = True
            if episode.epoch is None or episode.epoch == epoch:
                charges[tenant] = (episode.tokens, episode.requests)
            else:
                charges[tenant] = self._debt(tenant)
        self._episodes.clear()
        return charges

    def _debt(self, tenant: str) -> tuple[float, float]:
        share = self.limits(tenant)
        tokens_left, requests_left = self.store.levels_now(tenant)
        return (0.0 if share.tokens_per_minute is None
                else max(0.0, share.tokens_per_minute - tokens_left),
                0.0 if share.requests_per_minute is None
                else max(0.0, share.requests_per_minute - requests_left))
