"""Retry advice is true: every shed reason × what the guard knows → consistent headers.

No response carries a wait together with ``x-should-retry: false``; reasons a retry cannot help
never advise one; the first shed of a burst behind a full queue advises at least the queue's
drain estimate (known from the in-flight turnover before any completion is measured).
"""

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from guard.admission.shedding import RetryAdvisor
from guard.config import GuardConfig
from guard.controller import AdmissionController
from policies.decision import Shed
from policies.shed_reasons import ALL_REASONS, NEVER_RETRY
from tests.support.admission import FakeClock, SlotPolicy, make_cost, reserved


def controller(clock=None):
    return AdmissionController(GuardConfig(max_queue_len=600), registry=CollectorRegistry(),
                               clock=clock or FakeClock(10.0), policy=SlotPolicy(),
                               rng=random.Random(5))


def headers_of(rejection):
    return {k.decode(): v.decode() for k, v in rejection.headers(0)}


def check_consistent(rejection):
    h = headers_of(rejection)
    waits = "retry-after" in h, "retry-after-ms" in h
    if h["x-should-retry"] == "true":
        assert waits == (True, True) and int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 1
    else:
        assert waits == (False, False), h
    assert h["x-kvguard-reason"] == rejection.reason
    return h


@pytest.mark.parametrize("reason", ALL_REASONS)
@pytest.mark.parametrize("policy_says_retry", [True, False])
@pytest.mark.parametrize("policy_wait_s", [None, 0.01, 5.0])
@pytest.mark.parametrize("client_timeout", [None, "0.5", "600"])
def test_every_reason_and_header_combination_is_consistent(reason, policy_says_retry,
                                                           policy_wait_s, client_timeout):
    guard = controller()
    shed = Shed(503, reason, retry_after_s=policy_wait_s, should_retry=policy_says_retry)
    headers = {} if client_timeout is None else {"x-stainless-read-timeout": client_timeout}
    h = check_consistent(guard.rejecter.shed(make_cost(arrival_s=10.0), shed, headers, None))
    if reason in NEVER_RETRY or not policy_says_retry:
        assert h["x-should-retry"] == "false"
    elif client_timeout is None or client_timeout == "600":
        assert h["x-should-retry"] == "true"
        if policy_wait_s is not None:
            assert int(h["retry-after-ms"]) >= policy_wait_s * 1000
    if client_timeout == "0.5":  # every wait is at least the 1 s turnover: past the deadline
        assert h["x-should-retry"] == "false"


@settings(max_examples=200, deadline=None)
@given(status=st.sampled_from([429, 503]), reason=st.sampled_from(ALL_REASONS),
       should_retry=st.booleans(), wait_s=st.none() | st.floats(0, 1000),
       timeout=st.none() | st.floats(0.001, 1000), num_queued=st.integers(0, 40))
def test_no_response_advises_a_wait_without_should_retry(status, reason, should_retry, wait_s,
                                                         timeout, num_queued):
    async def main():
        guard = controller()
        for i in range(num_queued):
            guard.queue.push(make_cost(f"q{i}", arrival_s=10.0), 99.0, 10.0)
        headers = {} if timeout is None else {"x-stainless-read-timeout": repr(timeout)}
        shed = Shed(status, reason, retry_after_s=wait_s, should_retry=should_retry)
        check_consistent(guard.rejecter.shed(make_cost(arrival_s=10.0), shed, headers, None))
    asyncio.run(main())


def test_first_shed_behind_a_full_queue_advises_at_least_the_queue_drain():
    async def main():
        clock = FakeClock(10.0)
        guard = controller(clock)
        for i in range(4):  # four in flight, nothing completed yet: no drain rate measured
            guard.tickets.issue(reserved(make_cost(f"run{i}", arrival_s=10.0)), 10.0)
        for i in range(512):
            guard.queue.push(make_cost(f"q{i}", arrival_s=10.0), 99.0, 10.0)
        estimate_s = RetryAdvisor.queue_drain_s(num_ahead=512, drain_rate_rps=0.0,
                                                num_in_flight=4,
                                                service_s=guard.releases.service_s)
        rejection = guard.rejecter.shed(make_cost(arrival_s=10.0), Shed(503, "queue_full",
                                        retry_after_s=0.05), {}, None)
        assert rejection.should_retry and rejection.retry_after_s >= estimate_s >= 128.0
        assert int(headers_of(rejection)["retry-after-ms"]) >= estimate_s * 1000
    asyncio.run(main())
