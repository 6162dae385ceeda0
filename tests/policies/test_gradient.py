import pytest
from policy_builders import make_cost, make_replica, make_sample, make_snapshot

from policies.decision import Admit, Shed
from policies.gradient import Gradient


def inflight_snapshot(n):
    return make_snapshot(make_replica("a", inflight=n))


def test_defaults_are_gradient2s():
    g = Gradient()
    assert (g.limit, g.min_limit, g.max_limit, g.smoothing, g.queue_size) == (20, 20, 200, 0.2, 4)
    assert (g.long_window, g.warmup_samples) == (600, 10)


def test_admits_below_the_limit_and_sheds_at_it():
    g = Gradient(initial_limit=10, min_limit=2)
    assert g.decide(make_cost(), inflight_snapshot(9)) == Admit("a")
    assert g.decide(make_cost(), inflight_snapshot(10)) == Shed(503, "concurrency_limit")


def test_first_samples_follow_the_gradient2_formula():
    g = Gradient(
        initial_limit=10, min_limit=2, max_limit=50, queue_size=1, warmup_samples=1, long_window=99
    )
    # Warmup: long = short = 0.1, gradient 1: limit = 10 * 0.8 + (10 + 1) * 0.2.
    assert g.update(0.1, inflight=10) == pytest.approx(10.2)
    # Latency 4x: long = 0.1 * 0.98 + 0.4 * 0.02 = 0.106, gradient clamps to 0.5.
    assert g.update(0.4, inflight=10) == pytest.approx(10.2 * 0.8 + (10.2 * 0.5 + 1) * 0.2)
    assert g.long_s == pytest.approx(0.106)


def test_limit_shrinks_while_latency_rises_and_grows_back_when_it_falls():
    g = Gradient(
        initial_limit=20, min_limit=2, max_limit=50, queue_size=1, warmup_samples=1, long_window=99
    )
    for _ in range(5):
        g.update(0.1, inflight=20)
    steady = g.limit
    shrinking = [g.update(0.5, inflight=20) for _ in range(30)]
    assert all(b < a for a, b in zip([steady, *shrinking], shrinking, strict=False))
    assert int(g.limit) < 15
    low = g.limit
    assert g.decide(make_cost(), inflight_snapshot(int(low))) == Shed(503, "concurrency_limit")
    growing = [g.update(0.1, inflight=int(g.limit)) for _ in range(30)]
    assert all(b > a for a, b in zip([low, *growing], growing, strict=False))
    assert g.limit == pytest.approx(low + 30 * 1 * 0.2)  # gradient 1: + queue_size * smoothing each
    assert g.decide(make_cost(), inflight_snapshot(int(low))) == Admit("a")


def test_limit_stays_within_min_and_max():
    g = Gradient(initial_limit=5, min_limit=4, max_limit=6, queue_size=1, warmup_samples=1)
    for _ in range(50):
        g.update(0.1, inflight=5)
    assert g.limit == 6
    for _ in range(50):
        g.update(10.0, inflight=5)
    assert g.limit == 4


def test_app_limited_samples_do_not_move_the_limit():
    g = Gradient(initial_limit=20, min_limit=2, warmup_samples=1)
    g.update(0.1, inflight=20)
    before = g.limit
    assert g.update(1.0, inflight=int(before / 2) - 1) == before


def test_long_baseline_decays_fast_after_a_long_overload():
    g = Gradient(initial_limit=20, min_limit=2, warmup_samples=1)
    g.update(1.0, inflight=20)
    g.update(0.1, inflight=20)  # long ~1.0 is > 2x the new short sample: decayed by 0.9
    assert g.long_s == pytest.approx((1.0 * (1 - 2 / 601) + 0.1 * 2 / 601) * 0.9)


def test_observe_learns_from_ttft_with_the_inflight_count_at_admission():
    g = Gradient(initial_limit=4, min_limit=1, max_limit=50, queue_size=1, warmup_samples=1)
    for i in range(4):
        g.admitted(make_cost(f"r{i}"), "a", 0.0)
    g.observe(make_sample("r3", ttft_s=0.2))  # admitted 4th: 4 in flight, not app-limited
    assert g.limit == pytest.approx(4 * 0.8 + (4 + 1) * 0.2)
    g.observe(make_sample("r0", ttft_s=0.2))  # admitted 1st: 1 < 4.2 / 2, app-limited
    assert g.limit == pytest.approx(4.2)


def test_failed_unknown_and_measureless_samples_teach_nothing():
    g = Gradient(initial_limit=4, min_limit=1, warmup_samples=1)
    g.admitted(make_cost("r1"), "a", 0.0)
    g.admitted(make_cost("r2"), "a", 0.0)
    g.observe(make_sample("r1", ok=False, ttft_s=9.0))
    g.observe(make_sample("r2", ttft_s=None))
    g.observe(make_sample("never-admitted", ttft_s=0.1))
    assert (g.limit, g.num_samples) == (4, 0)


def test_max_itl_measure():
    g = Gradient(initial_limit=2, min_limit=1, warmup_samples=1, latency="max_itl")
    g.admitted(make_cost("r1"), "a", 0.0)
    g.observe(make_sample("r1", ttft_s=5.0, max_itl_s=0.03))
    assert g.long_s == pytest.approx(0.03)


@pytest.mark.parametrize(
    "params",
    [
        {"min_limit": 0},
        {"min_limit": 30, "max_limit": 20},
        {"initial_limit": 500},
        {"smoothing": 0.0},
        {"queue_size": -1},
        {"long_window": 0},
        {"rtt_tolerance": 0.5},
        {"latency": "p99"},
    ],
)
def test_rejects_bad_parameters(params):
    with pytest.raises(ValueError):
        Gradient(**params)
