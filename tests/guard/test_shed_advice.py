"""Retry advice is true: every shed reason × what the guard knows → consistent headers.

No response carries a wait together with ``x-should-retry: false``; reasons a retry cannot help
never advise one; a shed behind a full queue advises a wait within 2x of the time that queue
then takes to drain, fresh or warm, whether it drains through admissions or timeouts.
"""

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.controller import AdmissionController
from policies.decision import Queue, Shed
from policies.shed_reasons import ALL_REASONS, NEVER_RETRY
from tests.support.admission import BATCH, FakeClock, SlotPolicy, make_cost, reserved


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


class Replica:
    """``num_slots`` requests at a time, each done ``service_s`` after it starts: the guard's
    tickets are issued and released on the fake clock, so the advice learns what it would."""

    def __init__(self, guard, clock, num_slots: int, service_s: float) -> None:
        self.guard, self.clock = guard, clock
        self.num_slots, self.service_s = num_slots, service_s
        self.running = []
        self.num_served = 0

    def start(self, cost):
        self.running.append(self.guard.tickets.issue(reserved(cost), self.clock()))
        self.num_served += 1

    def step(self, dt_s: float) -> None:
        self.clock.advance(dt_s)
        done = [t for t in self.running if t.dispatch_s + self.service_s <= self.clock() + 1e-9]
        for ticket in done:
            self.running.remove(ticket)
            ticket.release("completed")

    def decide(self, cost, now_s, ahead):
        """The queue's pump: admit into a free slot, else keep waiting until the deadline."""
        if len(self.running) < self.num_slots:
            self.start(cost)
            return "admitted"
        return Queue(until_s=cost.deadline_s)

    def run_for(self, duration_s: float, arrivals_rps: float = 0.0, dt_s: float = 0.05) -> None:
        """Serve first arrivals (no queue) for ``duration_s``: what a warm guard has measured."""
        end_s = self.clock() + duration_s
        carry = 0.0
        while self.clock() < end_s:
            carry += arrivals_rps * dt_s
            while carry >= 1 and len(self.running) < self.num_slots:
                carry -= 1
                self.start(make_cost(f"w{self.num_served}", arrival_s=self.clock()))
            self.step(dt_s)

    def drain_s(self, dt_s: float = 0.05) -> float:
        """Pump the queue until it is empty; how long that took."""
        start_s = self.clock()
        while len(self.guard.queue):
            self.guard.queue.pump(self.decide, self.clock())
            if len(self.guard.queue):
                self.step(dt_s)
        return self.clock() - start_s


@pytest.mark.parametrize(("num_slots", "service_s", "warm"), [
    (4, 1.0, False),   # capacity far below the queue: it drains by timing out (the battery's case)
    (4, 1.0, True),
    (32, 1.0, False),  # capacity that clears the queue before its deadlines
    (32, 0.5, True),
])
def test_advice_behind_a_full_queue_is_within_2x_of_the_actual_drain(num_slots, service_s, warm):
    """The first shed behind a full queue advises a wait within [0.5x, 2x] of the time the
    queue then takes to empty (every shed is jittered upwards by at most 20 %)."""
    async def main():
        clock = FakeClock(10.0)
        guard = controller(clock)
        replica = Replica(guard, clock, num_slots, service_s)
        if warm:  # measured: completions at the replica's rate, service times
            replica.run_for(20.0, arrivals_rps=num_slots / service_s * 2)
        for i in range(num_slots - len(replica.running)):
            replica.start(make_cost(f"run{i}", arrival_s=clock()))
        for i in range(512):
            cost = make_cost(f"q{i}", klass=BATCH, arrival_s=clock())  # 30 s TTFT deadline
            guard.queue.push(cost, cost.deadline_s, clock())
        advices = [guard.rejecter.shed(make_cost(f"new{i}", arrival_s=clock()),
                                       Shed(503, "queue_full"), {}, None).retry_after_s
                   for i in range(3)]  # the retry budget advises 3 with no first attempts seen
        drained_s = replica.drain_s()
        assert drained_s > 1.0
        for advice_s in advices:
            assert 0.5 * drained_s <= advice_s <= 2.0 * drained_s, (advice_s, drained_s)
    asyncio.run(main())
