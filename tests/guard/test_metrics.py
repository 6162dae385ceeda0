from prometheus_client import CollectorRegistry

from guard.admission.ticket import TicketBook
from guard.observe.metrics import GuardMetrics
from tests.support.admission import FakeClock, make_cost, reserved


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_release_counts_outcomes_goodput_and_histograms():
    registry = CollectorRegistry()
    metrics = GuardMetrics(registry)
    clock = FakeClock()
    book = TicketBook(clock, (metrics.on_released,))
    good = book.issue(reserved(make_cost("g")), 0.0, predicted_ttft_s=0.25)
    good.on_start(200, b"text/event-stream")
    good.on_body(b'data: {"text":"a"}\n\n', True, 0.5)
    good.on_body(b"data: [DONE]\n\n", False, 0.52)
    clock.now_s = 0.6
    good.release(good.natural_outcome())
    gone = book.issue(reserved(make_cost("c")), 0.0)
    gone.release("canceled")
    bad = book.issue(reserved(make_cost("f", tenant="beta")), 0.0)
    bad.release("failed")

    lab = {"class": "interactive", "tenant": "acme"}
    assert _value(registry, "kvguard_requests_completed_total", **lab) == 1
    assert _value(registry, "kvguard_goodput_total", **lab) == 1
    assert _value(registry, "kvguard_requests_canceled_total", **lab) == 1
    assert _value(registry, "kvguard_requests_failed_total", **{"class": "interactive", "tenant": "beta"}) == 1
    assert _value(registry, "kvguard_time_to_first_token_seconds_count", **{"class": "interactive"}) == 1
    assert _value(registry, "kvguard_time_to_first_token_seconds_sum", **{"class": "interactive"}) == 0.5
    # (0.5 - 0.25) / 0.25 = +1.0 relative error
    err = {"class": "interactive"}
    assert _value(registry, "kvguard_ttft_prediction_error_ratio_bucket", le="1.0", **err) == 1
    assert _value(registry, "kvguard_ttft_prediction_error_ratio_bucket", le="0.5", **err) == 0
    assert _value(registry, "kvguard_request_duration_seconds_count", **{"class": "interactive"}) == 3


def test_tenant_labels_are_capped():
    metrics = GuardMetrics(CollectorRegistry(), max_tenants=2)
    assert [metrics.tenant_label(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_two_instances_do_not_share_state_and_render_text():
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    m1, m2 = GuardMetrics(r1), GuardMetrics(r2)
    m1.counters("interactive", "a").offered.inc()
    m1.rejected("interactive", "a", "overloaded").inc(2)
    assert _value(r2, "kvguard_requests_offered_total", **{"class": "interactive", "tenant": "a"}) == 0
    assert _value(r1, "kvguard_requests_offered_total", **{"class": "interactive", "tenant": "a"}) == 1
    assert _value(r1, "kvguard_requests_rejected_total", **{"class": "interactive", "tenant": "a", "reason": "overloaded"}) == 2
    assert b"kvguard_requests_offered_total" in m1.render()
    assert b"kvguard_queue_length" in m2.render()


def test_histogram_buckets_are_cumulative_and_gauges_read_at_scrape():
    from guard.observe.metrics import GaugeValues

    registry = CollectorRegistry()
    m = GuardMetrics(registry)
    for gap_s in (0.01, 0.05, 0.08, 0.3):
        m.histograms("interactive").itl.observe(gap_s)
    lab = {"class": "interactive"}
    assert _value(registry, "kvguard_inter_token_gap_seconds_bucket", le="0.01", **lab) == 1
    assert _value(registry, "kvguard_inter_token_gap_seconds_bucket", le="0.08", **lab) == 3
    assert _value(registry, "kvguard_inter_token_gap_seconds_bucket", le="+Inf", **lab) == 4
    assert _value(registry, "kvguard_inter_token_gap_seconds_count", **lab) == 4
    assert abs(_value(registry, "kvguard_inter_token_gap_seconds_sum", **lab) - 0.44) < 1e-9
    m.gauges = lambda: GaugeValues(3, 2, {"r0": 90}, {"r0": 10})
    assert _value(registry, "kvguard_queue_length") == 3
    assert _value(registry, "kvguard_held_tickets") == 2
    assert _value(registry, "kvguard_replica_free_blocks", replica="r0") == 90
    assert _value(registry, "kvguard_replica_reserved_blocks", replica="r0") == 10


def test_overflow_tenants_share_the_other_label():
    registry = CollectorRegistry()
    m = GuardMetrics(registry, max_tenants=1)
    m.counters("interactive", "a").offered.inc()
    m.counters("interactive", "b").offered.inc()
    m.counters("interactive", "c").offered.inc()
    assert _value(registry, "kvguard_requests_offered_total", **{"class": "interactive", "tenant": "a"}) == 1
    assert _value(registry, "kvguard_requests_offered_total", **{"class": "interactive", "tenant": "other"}) == 2
