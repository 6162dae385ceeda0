"""Picking the least-loaded replica: the routing rule every baseline shares."""

from __future__ import annotations

from collections.abc import Iterable

from policies.snapshot import ReplicaSnapshot

__all__ = ["least_loaded", "num_requests"]


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
