from policy_builders import decoding, make_cost, make_replica, make_snapshot

from policies.always_admit import AlwaysAdmit
from policies.decision import Admit, Shed


def test_admits_to_the_replica_with_fewest_requests():
    busy = make_replica("a", running=[decoding(), decoding()])
    idle = make_replica("b", running=[decoding()])
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(busy, idle)) == Admit("b")


def test_counts_the_guards_unreported_reservations_as_load():
    reserved = make_replica("a", reserved=[decoding(), decoding()], reserved_blocks=8)
    reported = make_replica("b", running=[decoding()])
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(reserved, reported)) == Admit("b")


def test_ties_break_on_kv_usage_then_replica_id():
    fuller = make_replica("a", free=10)
    emptier = make_replica("b", free=90)
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(fuller, emptier)) == Admit("b")
    assert AlwaysAdmit().decide(
        make_cost(), make_snapshot(make_replica("b"), make_replica("a"))
    ) == Admit("a")


def test_admits_however_loaded_even_with_no_free_blocks_or_stale_state():
    full = make_replica("a", free=0, running=[decoding()] * 8, observed_s=0.0)
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(full, now_s=100.0)) == Admit("a")


def test_skips_unhealthy_replicas_and_sheds_when_none_is_healthy():
    down = make_replica("a", healthy=False)
    up = make_replica("b", running=[decoding()] * 5)
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(down, up)) == Admit("b")
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(down)) == Shed(503, "no_replica")
    assert AlwaysAdmit().decide(make_cost(), make_snapshot()) == Shed(503, "no_replica")


def test_weight_divides_the_request_count():
    heavy = make_replica("a", running=[decoding()] * 5, weight=3.0)  # 5 / 3 < 2
    light = make_replica("b", running=[decoding()] * 2)
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(heavy, light)) == Admit("a")
    heavier = make_replica("a", running=[decoding()] * 7, weight=3.0)  # 7 / 3 > 2
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(heavier, light)) == Admit("b")


def test_weighted_least_loaded_splits_concurrent_requests_by_the_weights():
    """Admitting 40 requests that all stay in flight: 30 on the weight-3 replica, 10 on the
    weight-1 one (each admission is a reservation the next decision sees)."""
    counts = {"a": 0, "b": 0}
    for _ in range(40):
        replicas = [make_replica(rid, weight=w, reserved=[decoding()] * counts[rid],
                                 reserved_blocks=4 * counts[rid])
                    for rid, w in (("a", 3.0), ("b", 1.0))]
        counts[AlwaysAdmit().decide(make_cost(), make_snapshot(*replicas)).replica_id] += 1
    assert counts == {"a": 30, "b": 10}


def test_idle_replicas_tie_to_the_heavier_then_the_lower_id():
    light, heavy = make_replica("a"), make_replica("b", weight=2.0)
    assert AlwaysAdmit().decide(make_cost(), make_snapshot(light, heavy)) == Admit("b")
    assert AlwaysAdmit().decide(
        make_cost(), make_snapshot(make_replica("b"), make_replica("a"))) == Admit("a")
