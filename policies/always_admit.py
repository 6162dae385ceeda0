"""Always admit: an engine's unbounded queue (vLLM's default behaviour, no admission control).

Every request goes to the least-loaded healthy replica, however loaded; requests pile up in the
engine's waiting queue and the engine preempts when KV blocks run out. The only shed is 503
``no_replica`` when no replica is healthy (a load balancer with no backend).
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.decision import CompletionSample, Decision
from policies.least_loaded import NO_REPLICA, route_least_loaded
from policies.snapshot import LoadSnapshot

__all__ = ["AlwaysAdmit", "NO_REPLICA"]



class AlwaysAdmit:
    name = "always-admit"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        return route_least_loaded(snapshot)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        pass
