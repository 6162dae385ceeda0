"""The fleet kept in rank order as replicas change, for bounded candidate sets.

:class:`FleetRanking` holds every healthy, capacity-known replica's snapshot sorted by
:func:`policies.candidates.rank_key`. One replica's change (a state refresh, a reservation
made or released) moves its one entry: a forecast of the reference request and a bisection,
so keeping the ranking costs what changes, not the fleet's size. :meth:`FleetRanking.view`
is the immutable :class:`policies.candidates.RankedFleet` a snapshot carries (copying the
sorted list, a C-level copy, only after a change).

A rank key is computed at the first view after its replica changed, and the prefill pending
there drains as time passes, so a key grows stale even when its replica does not change: each
view also re-ranks ``num_refreshed`` more replicas, in turn (every key is at most
``replicas ÷ num_refreshed`` decisions old).

Below ``min_replicas`` replicas there is no ranking (``view()`` is None, policies scan the
fleet): forecasting every replica of so small a fleet costs less than keeping it ranked, and a
changed replica is ranked only once the view is asked for.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from policies.candidates import MIN_RANKED_REPLICAS, RankedFleet, rank_key
from policies.least_loaded import load_order
from policies.snapshot import ReplicaSnapshot
from policies.step_time import StepTimeModel

__all__ = ["FleetRanking"]


class FleetRanking:
    """Healthy, capacity-known replicas sorted by rank key; the fleet's order and limits."""

    def __init__(self, min_replicas: int = MIN_RANKED_REPLICAS, num_refreshed: int = 2) -> None:
        for key, value, minimum in (("min_replicas", min_replicas, 1),
                                    ("num_refreshed", num_refreshed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{key} must be an int >= {minimum}, got {value!r}")
        self._min_replicas = min_replicas
        self._num_refreshed = num_refreshed
        self._refresh_turn = 0
        self._latest: dict[str, tuple[ReplicaSnapshot, StepTimeModel]] = {}  # every replica
        self._ids: list[str] = []  # every replica id, in the order refreshes go round
        self._changed: dict[str, tuple[ReplicaSnapshot, StepTimeModel]] = {}
        self._entries: list[tuple] = []  # sorted (rank key, replica id)
        self._ranked: list[ReplicaSnapshot] = []  # the snapshots, parallel to _entries
        self._entry_of: dict[str, tuple] = {}
        self._limits: dict[str, tuple[int, int]] = {}  # max_model_len, num_total_blocks
        self._max_limits = (0, 0)
        self._position: dict[str, int] = {}
        self._load_orders: list[tuple] = []  # sorted load_order of every healthy replica
        self._by_load: list[ReplicaSnapshot] = []  # the snapshots, parallel to _load_orders
        self._load_order_of: dict[str, tuple] = {}
        self._num_inflight_of: dict[str, int] = {}
        self._num_inflight = 0
        self._view: RankedFleet | None = None

    def set_order(self, replica_ids: Iterable[str]) -> None:
        """The order of the snapshot's replicas (a replica joined the fleet)."""
        self._position = {rid: i for i, rid in enumerate(replica_ids)}
        self._view = None

    def update(self, replica: ReplicaSnapshot, step_time: StepTimeModel) -> None:
        """``replica``'s new snapshot, to be ranked under its own ``step_time`` model."""
        replica_id = replica.replica_id
        if replica_id not in self._latest:
            self._ids.append(replica_id)
        self._changed[replica_id] = self._latest[replica_id] = (replica, step_time)
        self._num_inflight += replica.num_inflight - self._num_inflight_of.get(replica_id, 0)
        self._num_inflight_of[replica_id] = replica.num_inflight
        limits = (replica.max_model_len, replica.num_total_blocks)
        if self._limits.get(replica_id) != limits:  # a replica's limits rarely change
            self._limits[replica_id] = limits
            self._max_limits = (max(m for m, _ in self._limits.values()),
                                max(b for _, b in self._limits.values()))
        self._view = None

    def remove(self, replica_id: str) -> None:
        """``replica_id`` left the fleet: unranked and forgotten."""
        if self._latest.pop(replica_id, None) is None:
            return
        self._discard(replica_id)
        self._ids.remove(replica_id)
        self._changed.pop(replica_id, None)
        self._num_inflight -= self._num_inflight_of.pop(replica_id, 0)
        self._limits.pop(replica_id, None)
        self._max_limits = (max((m for m, _ in self._limits.values()), default=0),
                            max((b for _, b in self._limits.values()), default=0))
        self._view = None

    def _rank(self, replica: ReplicaSnapshot, step_time: StepTimeModel,
              now_s: float | None) -> None:
        replica_id = replica.replica_id
        self._discard(replica_id)
        if replica.healthy:
            order = load_order(replica)
            i = bisect_left(self._load_orders, order)
            self._load_orders.insert(i, order)
            self._by_load.insert(i, replica)
            self._load_order_of[replica_id] = order
        if replica.healthy and replica.capacity_known:
            entry = (rank_key(replica, step_time, now_s), replica_id)
            i = bisect_left(self._entries, entry)
            self._entries.insert(i, entry)
            self._ranked.insert(i, replica)
            self._entry_of[replica_id] = entry

    def _refresh(self, now_s: float | None, done: dict) -> None:
        """Re-rank the next ``num_refreshed`` replicas in turn (their keys drift)."""
        ids = self._ids
        for _ in range(min(self._num_refreshed, len(ids))):
            replica_id = ids[self._refresh_turn % len(ids)]
            self._refresh_turn += 1
            if replica_id not in done:
                self._rank(*self._latest[replica_id], now_s)
        self._view = None

    def _discard(self, replica_id: str) -> None:
        entry = self._entry_of.pop(replica_id, None)
        if entry is not None:
            i = bisect_left(self._entries, entry)
            del self._entries[i]
            del self._ranked[i]
        order = self._load_order_of.pop(replica_id, None)
        if order is not None:
            i = bisect_left(self._load_orders, order)
            del self._load_orders[i]
            del self._by_load[i]

    def view(self, now_s: float | None = None) -> RankedFleet | None:
        """The ranking at ``now_s`` (the replicas changed since the last view are ranked at
        it), immutable, rebuilt only after a change; None below ``min_replicas`` replicas."""
        if len(self._limits) < self._min_replicas:
            return None
        view = self._view
        if view is None or self._num_refreshed:
            changed, self._changed = self._changed, {}
            for replica, step_time in changed.values():
                self._rank(replica, step_time, now_s)
            self._refresh(now_s, changed)
            by_load = self._by_load
            view = self._view = RankedFleet(tuple(self._ranked), self._position,
                                            *self._max_limits,
                                            by_load[0] if by_load else None,
                                            self._num_inflight)
        return view
