"""Always admit: an engine's unbounded queue (vLLM's default behaviour, no admission control).

Every request goes to the least-loaded healthy replica, however loaded; requests pile up in the
engine's waiting queue and the engine preempts when KV blocks run out. The only shed is 503
``no_replica`` when no replica is healthy (a load balancer with no backend).
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.decision import Admit, CompletionSample, Decision, Shed
from policies.least_loaded import least_loaded
from policies.snapshot import LoadSnapshot

__all__ = ["AlwaysAdmit", "NO_REPLICA"]

NO_REPLICA = "no_replica"


class AlwaysAdmit:
    name = "always-admit"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        replica = least_loaded(r for r in snapshot.replicas if r.healthy)
        if replica is None:
            return Shed(503, NO_REPLICA)
        return Admit(replica.replica_id)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        pass
