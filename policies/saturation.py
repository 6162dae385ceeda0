"""Saturation shedding: the Gateway API inference extension's endpoint picker (EPP).

The EPP's saturation detector calls a pod saturated when its metrics are stale, its waiting
queue is deeper than ``QueueDepthThreshold`` or its KV-cache utilisation is above
``KVCacheUtilThreshold``; the system is saturated when no pod has capacity, and then requests of
"sheddable" criticality are rejected. Defaults: queue depth 5, KV utilisation 0.8
(kubernetes-sigs/gateway-api-inference-extension, ``pkg/epp/saturationdetector/config.go``:
``DefaultQueueDepthThreshold = 5``, ``DefaultKVCacheUtilThreshold = 0.8``; both comparisons are
strict ``>``).

Like the EPP this policy sees only what the replicas' metrics say: the engine-reported waiting
queue and ``1 - free / total`` blocks, not the guard's unreported reservations (the scrape-lag
hole the baseline has in the field). All requests are treated as sheddable: when every fresh
replica is saturated the request is shed with 503 ``saturated``; otherwise it goes to the
unsaturated replica with the shortest waiting queue (divided by the replica's ``weight``), then
the lowest KV utilisation.
"""

from __future__ import annotations

from policies.always_admit import NO_REPLICA
from policies.cost import RequestCost
from policies.decision import Admit, CompletionSample, Decision, Shed
from policies.param_check import check_int
from policies.shed_reasons import SATURATED
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["Saturation", "SATURATED", "reported_kv_usage_ratio"]



def reported_kv_usage_ratio(replica: ReplicaSnapshot) -> float:
    """KV utilisation as the engine reports it (``vllm:kv_cache_usage_perc``)."""
    if replica.num_total_blocks <= 0:
        return 1.0
    return 1.0 - replica.num_free_blocks / replica.num_total_blocks


class Saturation:
    name = "saturation"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def __init__(self, max_waiting: int = 5, max_kv_usage_ratio: float = 0.8) -> None:
        if not 0.0 < max_kv_usage_ratio <= 1.0:
            raise ValueError(f"max_kv_usage_ratio must be in (0, 1], got {max_kv_usage_ratio!r}")
        self.max_waiting = check_int("max_waiting", max_waiting, 0)
        self.max_kv_usage_ratio = max_kv_usage_ratio

    def is_saturated(self, replica: ReplicaSnapshot) -> bool:
        return (
            len(replica.waiting) > self.max_waiting
            or reported_kv_usage_ratio(replica) > self.max_kv_usage_ratio
        )

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        if not any(r.healthy for r in snapshot.replicas):
            return Shed(503, NO_REPLICA)
        open_replicas = [r for r in snapshot.fresh_replicas() if not self.is_saturated(r)]
        if not open_replicas:
            return Shed(503, SATURATED)
        best = min(
            open_replicas,
            key=lambda r: (len(r.waiting) / r.weight, reported_kv_usage_ratio(r), -r.weight,
                           r.replica_id),
        )
        return Admit(best.replica_id)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        pass
