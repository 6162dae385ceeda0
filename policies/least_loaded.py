"""Picking the least-loaded replica: the routing rule every baseline shares."""

from __future__ import annotations

from collections.abc import Iterable

from policies.decision import Admit, Shed
from policies.shed_reasons import NO_REPLICA
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["NO_REPLICA", "least_loaded", "num_requests", "route_least_loaded"]



def num_requests(replica: ReplicaSnapshot) -> int:
    """Requests on the replica: reported running and waiting, plus the guard's unreported ones."""
    return len(replica.running) + len(replica.waiting) + len(replica.reserved)


def least_loaded(replicas: Iterable[ReplicaSnapshot]) -> ReplicaSnapshot | None:
    """Fewest requests, then most available KV blocks, then replica id; ``None`` when empty."""
    return min(
        replicas,
        key=lambda r: (num_requests(r), r.kv_usage_ratio, r.replica_id),
        default=None,
    )


def route_least_loaded(snapshot: LoadSnapshot) -> Admit | Shed:
    """Admit to the least-loaded healthy replica; 503 ``no_replica`` when none is healthy."""
    replica = least_loaded(r for r in snapshot.replicas if r.healthy)
    if replica is None:
        return Shed(503, NO_REPLICA)
    return Admit(replica.replica_id)
