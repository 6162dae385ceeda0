import pytest
from policy_builders import make_cost, make_replica, make_snapshot

from policies.concurrency_cap import ConcurrencyCap
from policies.decision import Admit, Shed


@pytest.mark.parametrize(
    ("inflight_a", "inflight_b", "expected"),
    [
        (0, 0, Admit("a")),
        (1, 1, Admit("a")),  # 2 in flight, cap 3: one more fits
        (2, 1, Shed(429, "concurrency_limit")),  # exactly at the cap
        (3, 2, Shed(429, "concurrency_limit")),
    ],
)
def test_cap_on_inflight_summed_over_replicas(inflight_a, inflight_b, expected):
    snapshot = make_snapshot(
        make_replica("a", inflight=inflight_a), make_replica("b", inflight=inflight_b)
    )
    assert ConcurrencyCap(3).decide(make_cost(), snapshot) == expected


def test_requests_on_an_unhealthy_replica_still_hold_their_slots():
    snapshot = make_snapshot(make_replica("a", inflight=2, healthy=False), make_replica("b"))
    assert ConcurrencyCap(2).decide(make_cost(), snapshot) == Shed(429, "concurrency_limit")
    assert ConcurrencyCap(3).decide(make_cost(), snapshot) == Admit("b")


def test_no_healthy_replica_under_the_cap_is_503():
    snapshot = make_snapshot(make_replica("a", healthy=False))
    assert ConcurrencyCap(3).decide(make_cost(), snapshot) == Shed(503, "no_replica")


def test_has_no_queue_and_keeps_no_state():
    policy = ConcurrencyCap(1)
    snapshot = make_snapshot(make_replica("a", inflight=1))
    policy.admitted(make_cost(), "a", 0.0)
    assert policy.decide(make_cost(), snapshot) == Shed(429, "concurrency_limit")
    assert policy.decide(make_cost(), make_snapshot(make_replica("a"))) == Admit("a")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_rejects_bad_caps(bad):
    with pytest.raises(ValueError, match="max_concurrency"):
        ConcurrencyCap(bad)
