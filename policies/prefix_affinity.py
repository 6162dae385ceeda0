"""Prefix affinity: llm-d's approximate prefix-cache routing, load-aware, sticky until saturated.

The llm-d inference scheduler (built on the Gateway API inference extension's endpoint picker)
routes by a weighted sum of scorers, each in ``[0, 1]``, and picks the highest total:

* the prefix-cache scorer (weight 3): the share of the prompt's blocks the replica is believed
  to hold (here ``cost.cached_prefix_tokens`` ÷ prompt tokens; in llm-d, matched ÷ total
  hashed chunks of its approximate index: the guard's approximate view is the same idea);
* the queue scorer (weight 2): ``(max - waiting) / (max - min)`` over the candidates' waiting
  queues, 1 for every replica when they are all equal;
* the KV-cache utilisation scorer (weight 2): ``1 - usage``.

Before scoring, a stickiness filter keeps only the replicas whose prefix score is at least
``affinity_threshold`` (0.8) — unless none of those has capacity, judged like the endpoint
picker's saturation detector (waiting queue over 5 or KV utilisation over 0.8): so a prefix
sticks to the replicas that hold it until they saturate, then spills to the least-loaded.

Like the endpoint picker this policy sees only what the replicas report (waiting queue, used
blocks), not the guard's unreported reservations, and it never sheds: a request that finds
every replica saturated still goes to the best-scored one (503 ``no_replica`` only when none
is healthy). Ties go to least-loaded order.
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.decision import Admit, CompletionSample, Decision, Shed
from policies.least_loaded import load_order
from policies.param_check import check, check_int
from policies.saturation import reported_kv_usage_ratio
from policies.shed_reasons import NO_REPLICA
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["PrefixAffinity", "prefix_score"]


def prefix_score(cost: RequestCost, replica: ReplicaSnapshot) -> float:
    """The share of the prompt the replica is believed to hold in its prefix cache."""
    cached = cost.cached_prefix_tokens
    if not cached or cost.num_prompt_tokens <= 0:
        return 0.0
    return min(1.0, cached.get(replica.replica_id, 0) / cost.num_prompt_tokens)


class PrefixAffinity:
    name = "prefix-affinity"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0,
                 kv_weight: float = 2.0, affinity_threshold: float = 0.8,
                 max_waiting: int = 5, max_kv_usage_ratio: float = 0.8) -> None:
        for name, weight in (("prefix_weight", prefix_weight), ("queue_weight", queue_weight),
                             ("kv_weight", kv_weight)):
            check(isinstance(weight, (int, float)) and not isinstance(weight, bool)
                  and weight >= 0, f"{name} must be a number >= 0, got {weight!r}")
        check(isinstance(affinity_threshold, (int, float)) and 0.0 < affinity_threshold <= 1.0,
              f"affinity_threshold must be in (0, 1], got {affinity_threshold!r}")
        check(isinstance(max_kv_usage_ratio, (int, float)) and 0.0 < max_kv_usage_ratio <= 1.0,
              f"max_kv_usage_ratio must be in (0, 1], got {max_kv_usage_ratio!r}")
        self.prefix_weight = float(prefix_weight)
        self.queue_weight = float(queue_weight)
        self.kv_weight = float(kv_weight)
        self.affinity_threshold = float(affinity_threshold)
        self.max_waiting = check_int("max_waiting", max_waiting, 0)
        self.max_kv_usage_ratio = float(max_kv_usage_ratio)

    def has_capacity(self, replica: ReplicaSnapshot) -> bool:
        """The endpoint picker's saturation test, negated."""
        return (len(replica.waiting) <= self.max_waiting
                and reported_kv_usage_ratio(replica) <= self.max_kv_usage_ratio)

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        candidates = [r for r in snapshot.replicas if r.healthy]
        if not candidates:
            return Shed(503, NO_REPLICA)
        sticky = [r for r in candidates if prefix_score(cost, r) >= self.affinity_threshold]
        if sticky and any(self.has_capacity(r) for r in sticky):
            candidates = [r for r in sticky if self.has_capacity(r)]
        waiting = [len(r.waiting) for r in candidates]
        low, high = min(waiting), max(waiting)

        def score(r: ReplicaSnapshot) -> float:
            queue = 1.0 if high == low else (high - len(r.waiting)) / (high - low)
            return (self.prefix_weight * prefix_score(cost, r) + self.queue_weight * queue
                    + self.kv_weight * (1.0 - reported_kv_usage_ratio(r)))

        best = min(candidates, key=lambda r: (-score(r), load_order(r)))
        return Admit(best.replica_id)

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        pass
