"""The SLO policy's stale rule: deciding without fresh replica state.

With no fresh state the policy cannot predict, so it admits to the least-loaded
(requests ÷ weight) healthy replica only while the guard's in-flight count is below
``stale_max_inflight_per_replica`` per healthy replica (a total: the weights split it). Where
the guard has learned replicas' concurrency limits (``ReplicaSnapshot.concurrency_limit``,
:mod:`policies.concurrency_limit`), each replica of unknown capacity is held to its own learned
limit instead (never above the sequences it says it runs at once, ``max_num_seqs``: llama.cpp's
slots) (the least-loaded replica still under its limit takes the request; the fixed cap
remains for replicas whose capacity is known but stale), and only where the replica's learned
dispatch-to-first-token time (``ReplicaSnapshot.first_token_s``) × ``ttft_safety_ratio`` still
lands by the deadline (``use_learned_limits = false`` keeps the fixed cap for every replica).
Beyond that it queues for at most ``stale_queue_s`` (state may refresh
meanwhile; never past the last moment a dispatch could still make the deadline) and sheds 503
``stale_state`` once even that would pass the deadline.

Pure: a function of the request, the snapshot and the healthy replicas.
"""

from __future__ import annotations

from policies.concurrency_cap import num_inflight
from policies.cost import RequestCost
from policies.decision import Admit, Decision, Queue, Shed
from policies.least_loaded import least_loaded
from policies.shed_reasons import RETRY_SHED, STALE_STATE
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["RETRY_OVER_BUDGET", "decide_stale", "is_retry_over_budget"]

RETRY_OVER_BUDGET = Shed(503, RETRY_SHED, should_retry=False)  # no wait: the client should stop


def is_retry_over_budget(cost: RequestCost, snapshot: LoadSnapshot) -> bool:
    return cost.is_retry and snapshot.retry_budget.is_over(cost.tenant)


def decide_stale(cost: RequestCost, snapshot: LoadSnapshot, healthy: list[ReplicaSnapshot],
                 max_inflight_per_replica: int, queue_s: float, use_learned_limits: bool,
                 ttft_safety_ratio: float) -> Decision:
    """Admit by load alone under the cap, else queue up to ``queue_s``, else shed."""
    now_s = snapshot.now_s
    latest_s = cost.deadline_s  # the last moment a dispatch can still make the deadline
    if use_learned_limits and any(r.concurrency_limit is not None for r in healthy):
        # learned limits: the least-loaded replica still under its own limit, where the
        # replica's usual first-token time (with the TTFT headroom) lands by the deadline
        open_ = [r for r in healthy
                 if r.num_inflight < _stale_limit(r, max_inflight_per_replica)
                 and now_s + _first_token_wait_s(r, cost, ttft_safety_ratio) <= cost.deadline_s]
        if open_:
            return Admit(least_loaded(open_).replica_id)
        latest_s -= min(_first_token_wait_s(r, cost, ttft_safety_ratio) for r in healthy)
    elif num_inflight(snapshot) < max_inflight_per_replica * len(healthy):
        return Admit(least_loaded(healthy).replica_id)
    if is_retry_over_budget(cost, snapshot):
        return RETRY_OVER_BUDGET
    until_s = min(latest_s, now_s + queue_s)
    if until_s > snapshot.now_s:
        return Queue(until_s, STALE_STATE)
    return Shed(503, STALE_STATE)


def _first_token_wait_s(replica: ReplicaSnapshot, cost: RequestCost,
                        ttft_safety_ratio: float) -> float:
    """The replica's learned first-token time with the TTFT headroom; 0 when unknown, or
    when even a request sent on arrival could not meet it: such an estimate cannot tell a
    request that will make it from one that will not, and refusing everything on it would
    stop the replica from ever being measured again."""
    wait_s = (replica.first_token_s or 0.0) * ttft_safety_ratio
    return wait_s if wait_s < cost.deadline_s - cost.arrival_s else 0.0


def _stale_limit(replica: ReplicaSnapshot, max_inflight_per_replica: int) -> int:
    """How many requests the stale rule lets run on ``replica``: its learned concurrency
    limit for a replica of unknown capacity, else the fixed per-replica cap."""
    if replica.concurrency_limit is not None and not replica.capacity_known:
        # never past the sequences it runs at once, where it says (llama.cpp's slots)
        return min(replica.concurrency_limit, replica.max_num_seqs)
    return max_inflight_per_replica
