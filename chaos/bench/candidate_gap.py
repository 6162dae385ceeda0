"""How much worse ``slo``'s bounded candidate set decides than its full scan, on a big fleet.

A guard's :class:`~guard.replicas.load_state.LoadState` is fed the synthetic documents of
:func:`chaos.bench.scale.fleet_document`; then ``num_decisions`` requests (prompts of 64 to
2,048 tokens) arrive evenly within one second (the fleet's state, observed at 0, stays
fresh throughout) and are decided twice on the same snapshot — by ``slo`` with
its candidate set and by ``slo`` scanning every replica — and admitted where the bounded one
says (each admission stays reserved, so the fleet fills up and later decisions meet queues
and sheds). Reported: the share of decisions of a different kind (admit vs queue vs shed),
the share of admits to another replica, and for decisions both admitted, how much later the
bounded choice's forecast first token is than the full scan's (mean, p99, max, in ms).
"""

from __future__ import annotations

import random
from dataclasses import replace

from guard.replicas.load_state import LoadState
from policies.cost import RequestClass, RequestCost
from policies.decision import Admit
from policies.slo import SloPolicy

__all__ = ["candidate_gap"]

_CLASS = RequestClass("interactive", ttft_s=1.0, itl_s=0.08)


def candidate_gap(load_state: LoadState, num_decisions: int, seed: int = 0) -> dict:
    """Bounded vs full-scan ``slo`` on ``load_state``'s fleet (its reservations grow)."""
    rng = random.Random(seed)
    bounded, full = SloPolicy(), SloPolicy()
    num_other_kind = num_other_replica = num_both_admitted = 0
    gaps_s = []
    for i in range(num_decisions):
        now_s = 0.5 + i / num_decisions
        num_prompt = rng.choice((64, 256, 512, 1024, 2048))
        cost = RequestCost(f"g{i}", "acme", _CLASS, num_prompt, 128, 64,
                           -(-(num_prompt + 128) // 16), arrival_s=now_s, deadline_s=now_s + 1.0)
        snapshot = load_state.snapshot(now_s)
        picked = bounded.decide(cost, snapshot)
        best = full.decide(cost, replace(snapshot, fleet=None))
        if type(picked) is not type(best):
            num_other_kind += 1
        elif isinstance(picked, Admit):
            num_both_admitted += 1
            if picked.replica_id != best.replica_id:
                num_other_replica += 1
            gaps_s.append(picked.predicted_ttft_s - best.predicted_ttft_s)
        if isinstance(picked, Admit):
            load_state.reserve(picked.replica_id, cost.request_id, cost, now_s)
    gaps_s.sort()
    return {
        "decisions": num_decisions,
        "other_kind_share": round(num_other_kind / num_decisions, 4),
        "other_replica_share": round(num_other_replica / max(1, num_both_admitted), 4),
        "ttft_gap_mean_ms": round(1000 * sum(gaps_s) / max(1, len(gaps_s)), 3),
        "ttft_gap_p99_ms": round(1000 * gaps_s[int(0.99 * (len(gaps_s) - 1))], 3)
        if gaps_s else 0.0,
        "ttft_gap_max_ms": round(1000 * gaps_s[-1], 3) if gaps_s else 0.0,
    }

