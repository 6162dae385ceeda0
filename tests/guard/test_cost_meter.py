"""kvguard_cost_dollars_total{component}: time-based components at the [cost] prices, and the
body bytes the guard relayed priced as network, by class and tenant; the same bytes and their
price on each request's trace line."""

import asyncio
import json

import pytest

from guard.config import TenantConfig, hash_api_key
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
                   for c in ("accelerator", "host", "idle_reserve")}
        dollars["network"] = sample(guard, "kvguard_cost_dollars_total", component="network",
                                    **{"class": "interactive", "tenant": "anonymous"})
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


def _network(guard) -> dict:
    return {(s.labels["class"], s.labels["tenant"]): s.value
            for family in guard.controller.registry.collect()
            if family.name == "kvguard_cost_dollars"
            for s in family.samples if s.labels.get("component") == "network" and s.labels.get("tenant")}


def test_network_is_split_by_class_and_tenant_and_traced_per_request(tmp_path):
    trace = tmp_path / "trace.jsonl"
    tenants = (TenantConfig("acme", hash_api_key("sk-acme"), may_choose_class=True),
               TenantConfig("beta", hash_api_key("sk-beta")))

    async def main():
        guard = make_guard(StreamApp(), cost=COST, tenants=tenants, trace_path=str(trace))
        sent = {}
        for key, cls in ((b"sk-acme", b"batch"), (b"sk-acme", None), (b"sk-beta", None)):
            headers = [(b"authorization", b"Bearer " + key)]
            if cls:
                headers.append((b"x-kvguard-class", cls))
            client = Client(PROMPT)
            await guard(http_scope(headers=headers), client.receive, client.send)
            assert client.status == 200
            who = ("acme" if key == b"sk-acme" else "beta", (cls or b"interactive").decode())
            sent[who] = len(PROMPT) + sum(len(m.get("body", b"")) for m in client.sent[1:])
        network = _network(guard)
        await guard.aclose()
        return sent, network

    sent, network = asyncio.run(asyncio.wait_for(main(), 10))
    assert network == {(cls, tenant): pytest.approx(n) for (tenant, cls), n in sent.items()}
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        n = line["num_request_bytes"] + line["num_response_bytes"]
        assert line["num_request_bytes"] == len(PROMPT)
        assert n == sent[(line["tenant"], line["class"])]
        assert line["network_usd"] == pytest.approx(n)  # $1 per byte
        assert "accelerator_usd" not in line  # the guard does not see engine steps


def test_time_accrued_components_carry_no_class_or_tenant():
    async def main():
        guard = make_guard(StreamApp(), cost=COST)
        families = [f for f in guard.controller.registry.collect()
                    if f.name == "kvguard_cost_dollars"]
        await guard.aclose()
        return families

    (family,) = asyncio.run(asyncio.wait_for(main(), 10))
    assert sorted(s.labels["component"] for s in family.samples) == [
        "accelerator", "host", "idle_reserve", "network"]
    assert all(set(s.labels) == {"component"} for s in family.samples)  # nothing relayed yet
