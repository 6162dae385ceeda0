"""RoundRobin: the next healthy replica in id order, the turn moving on booked admissions."""

from policy_builders import make_cost, make_replica, make_snapshot

from policies.decision import Admit, Shed
from policies.round_robin import RoundRobin


def book(policy, snapshot):
    decision = policy.decide(make_cost(), snapshot)
    policy.admitted(make_cost(), decision.replica_id, 0.0)
    return decision.replica_id


def test_turns_through_the_healthy_replicas_in_id_order():
    policy = RoundRobin()
    snapshot = make_snapshot(make_replica("c"), make_replica("a"), make_replica("b"))
    assert [book(policy, snapshot) for _ in range(5)] == ["a", "b", "c", "a", "b"]


def test_a_decision_not_booked_keeps_the_turn_and_unhealthy_replicas_are_skipped():
    policy = RoundRobin()
    snapshot = make_snapshot(make_replica("a"), make_replica("b", healthy=False),
                             make_replica("c"))
    assert policy.decide(make_cost(), snapshot) == Admit("a")
    assert policy.decide(make_cost(), snapshot) == Admit("a")  # not booked: same turn
    assert [book(policy, snapshot) for _ in range(3)] == ["a", "c", "a"]


def test_no_healthy_replica_is_a_503():
    decision = RoundRobin().decide(make_cost(), make_snapshot(make_replica("a", healthy=False)))
    assert decision == Shed(503, "no_replica")
