import asyncio
import json
import random

import pytest

from guard.admission.shedding import Rejection, RetryAdvisor, send_rejection


def _send_and_collect(rejection):
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(send_rejection(send, rejection))
    start, body = sent
    return start["status"], dict(start["headers"]), json.loads(body["body"])


def test_503_has_openai_body_and_retry_headers():
    status, headers, body = _send_and_collect(
        Rejection(503, "overloaded", "busy", retry_after_s=2.3, should_retry=True))
    assert status == 503
    assert body == {"error": {"message": "busy", "type": "overloaded_error", "param": None,
                              "code": "overloaded"}}
    assert headers[b"retry-after"] == b"3" and headers[b"retry-after-ms"] == b"2300"
    assert headers[b"x-should-retry"] == b"true" and headers[b"x-kvguard-reason"] == b"overloaded"
    assert int(headers[b"content-length"]) > 0


def test_retry_after_is_at_least_one_second():
    _, headers, _ = _send_and_collect(Rejection(429, "tenant_budget", "slow down", 0.2, True))
    assert headers[b"retry-after"] == b"1" and headers[b"retry-after-ms"] == b"200"


def test_400_never_retry_and_no_retry_after():
    status, headers, body = _send_and_collect(
        Rejection(400, "context_length_exceeded", "too long", param="max_tokens"))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "max_tokens"
    assert headers[b"x-should-retry"] == b"false" and b"retry-after" not in headers


@pytest.mark.parametrize("kwargs", [dict(status=200, reason="x", message="m"),
                                    dict(status=503, reason="", message="m"),
                                    dict(status=503, reason="x", message="m", retry_after_s=-1)])
def test_invalid_rejection_raises(kwargs):
    with pytest.raises(ValueError):
        Rejection(**kwargs)


def test_drain_rate_wait_with_jitter_bounds_and_seeded():
    a = RetryAdvisor(random.Random(7))
    b = RetryAdvisor(random.Random(7))
    waits = [a.retry_after_s(num_ahead=9, drain_rate_rps=5.0) for _ in range(200)]
    assert waits == [b.retry_after_s(num_ahead=9, drain_rate_rps=5.0) for _ in range(200)]
    assert all(2.0 <= w <= 2.4 for w in waits)  # (9 + 1) / 5 = 2 s, up to 20 % later
    assert len(set(waits)) > 100  # jittered, not a constant


def test_policy_estimate_is_a_floor_and_the_queue_counts_before_any_completion():
    adv = RetryAdvisor(random.Random(1), jitter_ratio=0.0)
    assert adv.retry_after_s(num_ahead=3, drain_rate_rps=1.0, policy_retry_after_s=0.5) == 4.0
    assert adv.retry_after_s(num_ahead=3, drain_rate_rps=1.0, policy_retry_after_s=9.0) == 9.0
    # no completion measured yet: 4 in flight turning over every 2 s, 511 queued ahead
    assert adv.retry_after_s(num_ahead=511, drain_rate_rps=0.0, num_in_flight=4,
                             service_s=2.0) == 256.0
    assert adv.retry_after_s(num_ahead=3, drain_rate_rps=0.0, service_s=0.7) == 4 * 0.7


def test_the_queue_horizon_caps_the_queue_estimate_but_not_the_policys():
    adv = RetryAdvisor(random.Random(1), jitter_ratio=0.0)
    # 511 queued that have all left within 30 s (admitted or timed out): not 256 s
    assert adv.retry_after_s(num_ahead=511, drain_rate_rps=0.0, num_in_flight=4,
                             service_s=2.0, queue_horizon_s=30.0) == 30.0
    assert adv.retry_after_s(num_ahead=3, drain_rate_rps=1.0, queue_horizon_s=30.0) == 4.0
    # the next slot frees later than the queue empties: that is the wait
    assert adv.retry_after_s(num_ahead=1, drain_rate_rps=0.0, expected_free_s=12.0,
                             queue_horizon_s=3.0) == 12.0
    assert adv.retry_after_s(num_ahead=511, drain_rate_rps=0.0, num_in_flight=4,
                             policy_retry_after_s=40.0, queue_horizon_s=30.0) == 40.0


def test_should_retry_rules():
    assert RetryAdvisor.should_retry(2.0, None)
    assert RetryAdvisor.should_retry(2.0, 5.0)
    assert not RetryAdvisor.should_retry(6.0, 5.0)
    assert not RetryAdvisor.should_retry(0.1, None, can_ever_fit=False)


def test_expected_free_time_is_used_when_it_exceeds_the_drain_estimate():
    adv = RetryAdvisor(random.Random(1), jitter_ratio=0.0)
    # a batch finishes together: the average rate says 0.25 s, the in-flight ones say 1.5 s
    assert adv.retry_after_s(num_ahead=0, drain_rate_rps=4.0, expected_free_s=1.5) == 1.5
    assert adv.retry_after_s(num_ahead=0, drain_rate_rps=4.0, expected_free_s=0.1) == 0.25
    assert adv.retry_after_s(num_ahead=0, drain_rate_rps=0.0, expected_free_s=0.8) == 0.8


@pytest.mark.parametrize(("status", "reason", "kind", "code"), [
    (401, "invalid_api_key", "invalid_request_error", "invalid_api_key"),
    (429, "rpm_limit", "requests", "rate_limit_exceeded"),
    (429, "tpm_limit", "tokens", "rate_limit_exceeded"),
    (429, "concurrency_limit", "requests", "rate_limit_exceeded"),
    (503, "no_replica", "overloaded_error", "no_replica"),
])
def test_error_bodies_follow_openai_conventions(status, reason, kind, code):
    error = json.loads(Rejection(status, reason, "m").body())["error"]
    assert (error["type"], error["code"]) == (kind, code)
