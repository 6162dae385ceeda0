"""Round robin: each request to the next healthy replica in turn, whatever its load or cache.

The load balancer in front of most fleets (Kubernetes Services, Envoy's default): no
admission control, no affinity. Replicas are taken in replica-id order; the turn moves on
when an admission is booked (:meth:`RoundRobin.admitted`), so a request decided again (the
guard's queue, a redispatch) gets the same replica until one is booked. The only shed is 503
``no_replica`` when no replica is healthy.
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.decision import Admit, CompletionSample, Decision, Shed
from policies.shed_reasons import NO_REPLICA
from policies.snapshot import LoadSnapshot

__all__ = ["RoundRobin"]


class RoundRobin:
    name = "round-robin"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def __init__(self) -> None:
        self._last_id: str | None = None  # the replica the last booked admission went to

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        healthy = sorted(r.replica_id for r in snapshot.replicas if r.healthy)
        if not healthy:
            return Shed(503, NO_REPLICA)
        last = self._last_id
        for replica_id in healthy:  # the first id after the last one booked, wrapping around
            if last is None or replica_id > last:
                return Admit(replica_id)
        return Admit(healthy[0])

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        self._last_id = replica_id

    def observe(self, sample: CompletionSample) -> None:
        pass
