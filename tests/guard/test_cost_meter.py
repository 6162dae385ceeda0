"""kvguard_cost_dollars_total{component}: time-based components at the [cost] prices, and the
body bytes the guard relayed priced as network."""

import asyncio

import pytest

from guard.observe.cost_config import CostConfig
from tests.guard.test_middleware import StreamApp, sample
from tests.support.admission import PROMPT, Client, FakeClock, http_scope, make_guard

COST = CostConfig(accelerator_usd_per_hour=3.6, host_usd_per_hour=0.36, network_usd_per_gb=1e9,
                  idle_reserve_replicas=2)  # $1 per byte makes the byte count exact


def test_a_relayed_request_accrues_every_component():
    async def main():
        clock = FakeClock(1.0)
        guard = make_guard(StreamApp(), clock=clock, cost=COST)
        client = Client(PROMPT)
        await guard(http_scope(), client.receive, client.send)
        clock.advance(100.0)
        dollars = {c: sample(guard, "kvguard_cost_dollars_total", component=c)
                   for c in ("accelerator", "host", "network", "idle_reserve")}
        body_bytes = sum(len(m.get("body", b"")) for m in client.sent[1:])
        await guard.aclose()
        return dollars, body_bytes

    dollars, response_bytes = asyncio.run(asyncio.wait_for(main(), 10))
    assert dollars["accelerator"] == pytest.approx(100 * 0.001)  # one in-process replica
    assert dollars["host"] == pytest.approx(2 * 100 * 0.0001)  # the replica and this guard
    assert dollars["idle_reserve"] == pytest.approx(2 * 100 * 0.0011)
    assert dollars["network"] == pytest.approx(response_bytes + len(PROMPT))


def test_no_cost_table_still_exports_the_default_accelerator_price():
    async def main():
        clock = FakeClock(1.0)
        guard = make_guard(StreamApp(), clock=clock)
        clock.advance(3600.0)
        value = sample(guard, "kvguard_cost_dollars_total", component="accelerator")
        network = sample(guard, "kvguard_cost_dollars_total", component="network")
        await guard.aclose()
        return value, network

    value, network = asyncio.run(asyncio.wait_for(main(), 10))
    assert value == pytest.approx(3.24) and network == 0.0
