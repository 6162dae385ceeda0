"""A fixed cap on in-flight requests: TGI's ``--max-concurrent-requests``.

TGI answers 429 ("Model is overloaded") once that many requests are in flight and keeps no
queue in front of the cap. Here the in-flight count is the guard's own (``num_inflight``
summed over every replica, healthy or not: a request on a dying replica still holds a slot).
Admitted requests go to the least-loaded healthy replica.
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.decision import CompletionSample, Decision, Shed
from policies.least_loaded import route_least_loaded
from policies.param_check import check_int
from policies.shed_reasons import CONCURRENCY_LIMIT
from policies.snapshot import LoadSnapshot

__all__ = ["ConcurrencyCap", "CONCURRENCY_LIMIT", "num_inflight"]



def num_inflight(snapshot: LoadSnapshot) -> int:
    """Requests this guard has admitted and not yet released, over all replicas."""
    fleet = snapshot.fleet
    if fleet is not None:  # kept by the guard as replicas change
        return fleet.num_inflight
    return sum(r.num_inflight for r in snapshot.replicas)


class ConcurrencyCap:
    name = "concurrency-cap"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def __init__(self, max_concurrency: int = 128) -> None:
        self.max_concurrency = check_int("max_concurrency", max_concurrency, 1)

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        if num_inflight(snapshot) >= self.max_concurrency:
            return Shed(429, CONCURRENCY_LIMIT)
        return route_least_loaded(snapshot)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        pass
