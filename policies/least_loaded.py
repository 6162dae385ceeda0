"""Picking the least-loaded replica: the routing rule every baseline shares.

Load is counted in requests (reported running and waiting plus the guard's unreported ones) and
divided by the replica's ``weight``: with weights 3 and 1, the first replica is "as loaded" as
the second when it holds three times as many requests, so concurrent traffic splits 3 : 1.
Ties go to the replica with more free KV, then the heavier one, then the lower id — a fixed
order, never the order in which the replicas' states happened to arrive.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.decision import Admit, Shed
from policies.shed_reasons import NO_REPLICA
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["NO_REPLICA", "least_loaded", "load_order", "num_requests", "route_least_loaded",
           "weighted_load"]


def num_requests(replica: ReplicaSnapshot) -> int:
    """Requests on the replica: reported running and waiting, plus the guard's unreported ones
    (the count its load already holds: kept on the snapshot, whatever holds the groups)."""
    return replica.load.num_seqs


def weighted_load(replica: ReplicaSnapshot) -> float:
    """``num_requests ÷ weight``: the load least-loaded routing compares."""
    return num_requests(replica) / replica.weight


def load_order(replica: ReplicaSnapshot) -> tuple[float, float, float, str]:
    """Sort key of least-loaded routing: weighted load, KV usage, heavier first, replica id."""
    return (weighted_load(replica), replica.kv_usage_ratio, -replica.weight, replica.replica_id)


def least_loaded(replicas: Iterable[ReplicaSnapshot]) -> ReplicaSnapshot | None:
    """The first replica in :func:`load_order`; ``None`` when there is none."""
    if isinstance(replicas, (list, tuple)) and len(replicas) == 1:
        return replicas[0]  # one candidate: no order to compute (a proxy before one replica)
    return min(replicas, key=load_order, default=None)


def route_least_loaded(snapshot: LoadSnapshot) -> Admit | Shed:
    """Admit to the least-loaded healthy replica; 503 ``no_replica`` when none is healthy.
    A snapshot carrying the guard's ranked fleet names that replica already."""
    fleet = snapshot.fleet
    if fleet is not None:
        if fleet.least_loaded is None:
            return Shed(503, NO_REPLICA)
        return Admit(fleet.least_loaded.replica_id)
    healthy = []  # a plain loop: a generator is one more call per replica, per request
    for replica in snapshot.replicas:
        if replica.healthy:
            healthy.append(replica)
    replica = least_loaded(healthy)
    if replica is None:
        return Shed(503, NO_REPLICA)
    return Admit(replica.replica_id)
