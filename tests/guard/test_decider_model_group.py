"""The decider narrows a request to its model's replicas, and keeps the ranked fleet when
that group is every replica (else ``slo`` scans all 256 replicas on every decision)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from chaos.bench.scale import fleet_document
from guard.admission.decider import Decider
from guard.admission.queue import AdmissionQueue
from guard.admission.retry_budgets import RetryBudgets
from guard.admission.shedding import DrainRate
from guard.observe.metrics import GuardMetrics
from guard.replicas.load_state import LoadState
from policies.cost import RequestClass, RequestCost
from policies.decision import Shed
from policies.retry_budget import RetryBudgetConfig


class Recorder:
    """A policy that sheds and keeps each snapshot it was asked about."""

    def __init__(self) -> None:
        self.snapshots = []

    def decide(self, cost, snapshot):
        self.snapshots.append(snapshot)
        return Shed(503, "test")


def make(num_replicas: int) -> tuple[Decider, Recorder]:
    load_state = LoadState(max_staleness_s=60.0)
    for k in range(num_replicas):
        load_state.update_from_kvguard_state(f"r{k}", fleet_document(k, 4), 0.0)
    policy = Recorder()
    clock = lambda: 0.5  # noqa: E731
    return Decider(policy, load_state, AdmissionQueue(8, clock), DrainRate(),
                   RetryBudgets(RetryBudgetConfig()), GuardMetrics(CollectorRegistry()), clock,
                   None), policy


def cost(replica_ids: frozenset[str] | None) -> RequestCost:
    c = RequestCost(f"q{random.random()}", "acme", RequestClass("interactive", 1.0, 0.08),
                    512, 128, 64, 40, arrival_s=0.5, deadline_s=1.5)
    c.replica_ids = replica_ids
    return c


def test_a_model_every_replica_serves_keeps_the_ranked_fleet():
    decider, policy = make(40)
    every = frozenset(f"r{k}" for k in range(40))
    for _ in range(2):  # the second time from the remembered group
        decider.decide(cost(every), 0.5)
    decider.decide(cost(None), 0.5)
    assert [s.fleet is not None and bool(s.fleet.ranked) for s in policy.snapshots] == [True] * 3
    assert all(len(s.replicas) == 40 for s in policy.snapshots)


def test_a_model_some_replicas_serve_is_decided_among_them_alone():
    decider, policy = make(40)
    every = frozenset(f"r{k}" for k in range(40))
    decider.decide(cost(every), 0.5)
    decider.decide(cost(every - {"r7"}), 0.5)
    decider.decide(cost(frozenset({"r1", "r2"})), 0.5)
    assert policy.snapshots[1].fleet is None
    assert {r.replica_id for r in policy.snapshots[1].replicas} == every - {"r7"}
    assert {r.replica_id for r in policy.snapshots[2].replicas} == {"r1", "r2"}
