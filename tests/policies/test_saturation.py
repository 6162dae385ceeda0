import pytest
from policy_builders import decoding, make_cost, make_replica, make_snapshot, prompt_waiting

from policies.decision import Admit, Shed
from policies.saturation import Saturation


def waiting(n):
    return [prompt_waiting()] * n


def test_defaults_are_the_endpoint_pickers():
    policy = Saturation()
    assert (policy.max_waiting, policy.max_kv_usage_ratio) == (5, 0.8)


@pytest.mark.parametrize(
    ("num_waiting", "free", "expected"),
    [
        (5, 20, Admit("a")),  # queue 5 and KV 0.80: both at the threshold, not over it
        (6, 20, Shed(503, "saturated")),
        (0, 19, Shed(503, "saturated")),  # KV 0.81
        (0, 0, Shed(503, "saturated")),  # no free blocks
    ],
)
def test_thresholds_are_strict(num_waiting, free, expected):
    snapshot = make_snapshot(make_replica("a", free=free, waiting=waiting(num_waiting)))
    assert Saturation().decide(make_cost(), snapshot) == expected


def test_admits_to_the_unsaturated_replica_with_the_shortest_queue_then_lowest_kv():
    saturated = make_replica("a", waiting=waiting(9), free=90)
    longer = make_replica("b", waiting=waiting(3), free=90)
    shorter = make_replica("c", waiting=waiting(1), free=30)
    emptier = make_replica("d", waiting=waiting(1), free=60)
    assert Saturation().decide(
        make_cost(), make_snapshot(saturated, longer, shorter, emptier)
    ) == Admit("d")


def test_sees_only_the_engine_metrics_not_the_guards_reservations():
    replica = make_replica("a", free=50, reserved=[decoding()] * 9, reserved_blocks=45)
    assert Saturation().decide(make_cost(), make_snapshot(replica)) == Admit("a")


def test_stale_replicas_count_as_saturated():
    stale = make_replica("a", observed_s=0.0)
    fresh_but_full = make_replica("b", observed_s=9.5, free=0)
    snapshot = make_snapshot(stale, fresh_but_full, now_s=10.0)
    assert Saturation().decide(make_cost(), snapshot) == Shed(503, "saturated")
    fresh = make_replica("c", observed_s=9.5)
    assert Saturation().decide(make_cost(), make_snapshot(stale, fresh, now_s=10.0)) == Admit("c")


def test_no_healthy_replica_is_503_no_replica():
    snapshot = make_snapshot(make_replica("a", healthy=False))
    assert Saturation().decide(make_cost(), snapshot) == Shed(503, "no_replica")


def test_custom_thresholds():
    snapshot = make_snapshot(make_replica("a", waiting=waiting(1), free=50))
    assert Saturation(max_waiting=0).decide(make_cost(), snapshot) == Shed(503, "saturated")
    assert Saturation(max_kv_usage_ratio=0.4).decide(make_cost(), snapshot) == Shed(
        503, "saturated"
    )


@pytest.mark.parametrize(
    "params",
    [
        {"max_waiting": -1},
        {"max_waiting": 2.5},
        {"max_kv_usage_ratio": 0.0},
        {"max_kv_usage_ratio": 1.5},
    ],
)
def test_rejects_bad_thresholds(params):
    with pytest.raises(ValueError):
        Saturation(**params)
