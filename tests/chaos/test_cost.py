"""Cost accounting identities over synthetic steps and fates (pure functions, exact numbers)."""

import math

import pytest

from chaos.cost import Fleet, RequestFate, Step, StepWork, WorkWeights, window_cost
from chaos.goodput import Window
from guard.observe.cost_config import CostConfig

# $3.60/h = $0.001/s per replica; $0.36/h host
CFG = CostConfig(accelerator_usd_per_hour=3.6, host_usd_per_hour=0.36, network_usd_per_gb=0.1,
                 idle_reserve_replicas=1)
WEIGHTS = WorkWeights(per_prefill_token_s=1.0, per_decode_token_s=4.0, per_kv_read_token_s=0.01)


def _steps():
    return [
        Step("r0", 1.0, 2.0, (StepWork("a", num_prefill_tokens=100), StepWork("b", 20))),
        Step("r0", 2.0, 2.5, (StepWork("a", num_decode_tokens=1, num_kv_read_tokens=100),
                              StepWork("b", num_decode_tokens=1, num_kv_read_tokens=20))),
        Step("r1", 9.5, 10.5, (StepWork("c", 30, num_recomputed_tokens=15),)),  # crosses the end
    ]


FATES = [RequestFate("a", 1.0, "good", "interactive", "acme", 8),
         RequestFate("b", 1.0, "late", "interactive", "beta", 8),
         RequestFate("c", 5.0, "good", "batch", "acme", 4)]


def test_components_sum_to_total_and_requests_plus_idle_make_the_accelerator():
    cost = window_cost(Window(0.0, 10.0), _steps(), FATES, CFG, Fleet(2, 1, network_bytes=10**9), WEIGHTS)
    c = cost.components_usd
    assert c["accelerator"] == pytest.approx(2 * 10 * 0.001)
    assert c["host"] == pytest.approx(3 * 10 * 0.0001)
    assert c["network"] == pytest.approx(0.1)
    assert c["idle_reserve"] == pytest.approx(10 * (0.001 + 0.0001))
    assert cost.total_usd == pytest.approx(sum(c.values()), rel=1e-12)
    assert sum(cost.request_usd.values()) + cost.accelerator_idle_usd == \
        pytest.approx(c["accelerator"], rel=1e-9)
    assert cost.accelerator_busy_usd == pytest.approx(2.0 * 0.001)  # 1 + 0.5 + 0.5 s clipped


def test_busy_time_is_shared_by_each_steps_work():
    cost = window_cost(Window(0.0, 10.0), _steps(), FATES, CFG, Fleet(2), WEIGHTS)
    # step 1: 100 vs 20 prefill tokens; step 2: 4 + 1.0 vs 4 + 0.2
    a = 0.001 * 100 / 120 + 0.0005 * 5.0 / 9.2
    b = 0.001 * 20 / 120 + 0.0005 * 4.2 / 9.2
    assert cost.request_usd["a"] == pytest.approx(a, rel=1e-12)
    assert cost.request_usd["b"] == pytest.approx(b, rel=1e-12)
    assert cost.request_usd["c"] == pytest.approx(0.0005, rel=1e-12)  # half of its step inside


def test_wasted_is_late_requests_plus_recomputation_by_class_and_tenant():
    cost = window_cost(Window(0.0, 10.0), _steps(), FATES, CFG, Fleet(2), WEIGHTS)
    b, c_recomputed = cost.request_usd["b"], cost.request_usd["c"] / 2
    assert cost.wasted_usd == pytest.approx(b + c_recomputed)
    assert cost.wasted_by_class_usd == pytest.approx({"interactive": b, "batch": c_recomputed})
    assert cost.wasted_by_tenant_usd == pytest.approx({"beta": b, "acme": c_recomputed})
    assert cost.wasted_share == pytest.approx(cost.wasted_usd / cost.total_usd)


def test_good_requests_are_counted_by_arrival_like_goodput():
    first = window_cost(Window(0.0, 2.0), _steps(), FATES, CFG, Fleet(2), WEIGHTS)
    assert first.num_good == 1 and first.num_good_output_tokens == 8
    assert first.cost_per_good_request_usd == pytest.approx(first.total_usd)
    assert first.cost_per_million_good_output_tokens_usd == pytest.approx(first.total_usd / 8 * 1e6)
    assert first.fates["late"] == 1


def test_no_traffic_is_all_idle_plus_reserve_and_cost_per_good_request_is_undefined():
    cost = window_cost(Window(0.0, 60.0), [], [], CFG, Fleet(4, 0))
    assert cost.accelerator_busy_usd == 0.0 and cost.request_usd == {}
    assert cost.accelerator_idle_usd == cost.components_usd["accelerator"] == pytest.approx(0.24)
    assert cost.total_usd == pytest.approx(0.24 + 4 * 60 * 0.0001 + 60 * 0.0011)
    assert cost.cost_per_good_request_usd is None
    assert cost.cost_per_million_good_output_tokens_usd is None
    assert cost.to_dict()["cost_per_good_request_usd"] is None


def test_a_window_with_only_late_requests_has_no_cost_per_good_request():
    fates = [RequestFate("a", 1.0, "late"), RequestFate("b", 1.0, "failed")]
    cost = window_cost(Window(0.0, 10.0), _steps()[:2], fates, CFG, Fleet(1))
    assert cost.cost_per_good_request_usd is None
    assert not math.isinf(cost.total_usd) and cost.wasted_usd == pytest.approx(0.0015)


def test_steps_busier_than_the_fleet_are_refused():
    with pytest.raises(ValueError, match="busy"):
        window_cost(Window(0.0, 10.0), _steps(), FATES, CFG, Fleet(0))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        RequestFate("a", 0.0, "fine")
    with pytest.raises(ValueError):
        WorkWeights(0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        Step("r0", 2.0, 1.0, ())
