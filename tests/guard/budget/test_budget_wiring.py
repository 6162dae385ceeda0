"""Budget configuration, the store a config builds, and 429s through the real middleware."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from guard.budget import BudgetConfig, BudgetLimits, FallbackStore, MemoryStore, build_budget_store
from guard.config import GuardConfig, load_config
from guard.middleware import AdmissionMiddleware

EXAMPLE = Path(__file__).parents[3] / "docs" / "guard-config.example.toml"


def config(**data) -> GuardConfig:
    return GuardConfig.from_dict({"policy": "always-admit", **data})


def tenant(**limits) -> dict:
    return {"name": "acme", "api_key": "k-acme", **limits}


def test_tenant_limits_override_the_default_axis_by_axis():
    c = config(budget={"tokens_per_minute": 1000, "requests_per_minute": 10},
               tenants=[tenant(requests_per_minute=50, max_concurrent=3)])
    assert c.budget_limits("acme") == BudgetLimits(1000, 50, 3)
    assert c.budget_limits("anonymous") == BudgetLimits(1000, 10, None)
    assert c.budgets_enabled and not config().budgets_enabled
    assert config(tenants=[tenant(max_concurrent=1)]).budgets_enabled


@pytest.mark.parametrize("data, key", [
    ({"budget": {"tokens_per_minute": 0}}, "budget.tokens_per_minute"),
    ({"budget": {"lease_s": -1}}, "budget.lease_s"),
    ({"budget": {"redis_timeout_s": 30.0}}, "budget.redis_timeout_s"),
    ({"budget": {"heartbeat_s": 20.0}}, "budget.lease_s"),
    ({"budget": {"breaker_failures": 0}}, "budget.breaker_failures"),
    ({"budget": {"expected_guards": 0}}, "budget.expected_guards"),
    ({"budget": {"expected_guards": 2.5}}, "budget.expected_guards"),
    ({"budget": {"reserve_ahead": "yes"}}, "budget.reserve_ahead"),
    ({"budget": {"colour": 1}}, "budget.colour"),
    ({"budget": 5}, "budget"),
    ({"tenants": [tenant(requests_per_minute=-3)]}, "requests_per_minute"),
    ({"tenants": [tenant(max_concurrent=1.5)]}, "max_concurrent"),
    ({"redis_url": "http://127.0.0.1:6379"}, "redis_url"),
])
def test_bad_budget_config_names_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config(**data)


def test_the_example_config_loads_with_its_budgets():
    c = load_config(EXAMPLE, env={})
    assert c.budget == BudgetConfig()
    assert c.budget_limits("acme") == BudgetLimits(200000, 1200, 64)


def test_the_store_follows_the_config():
    clock = lambda: 0.0  # noqa: E731
    assert build_budget_store(config(), clock) is None
    assert isinstance(build_budget_store(config(tenants=[tenant(max_concurrent=1)]), clock),
                      MemoryStore)
    store = build_budget_store(config(tenants=[tenant(max_concurrent=1)],
                                      redis_url="redis://127.0.0.1:1/0"), clock, CollectorRegistry())
    assert isinstance(store, FallbackStore) and store.backend == "local"


async def ok_app(scope, receive, send):
    if scope["method"] != "POST":  # no /kvguard/state: one replica of unknown capacity
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(
        {"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode()})


def test_middleware_answers_429_from_the_tenant_budget_and_refunds_on_completion():
    guard = AdmissionMiddleware(ok_app, config(tenants=[tenant(tokens_per_minute=100)]),
                                registry=CollectorRegistry())
    headers = {"authorization": "Bearer k-acme"}

    async def go():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
            async def post(max_tokens):
                return await client.post("/v1/completions", headers=headers,
                                         json={"model": "m", "prompt": "hello", "max_tokens": max_tokens})
            never = await post(500)
            assert never.status_code == 429 and never.headers["x-kvguard-reason"] == "tpm_limit"
            assert never.headers["x-should-retry"] == "false"
            statuses = []
            for _ in range(5):  # each reserves ~42 and settles 7: the refunds let all through
                statuses.append((await post(40)).status_code)
                await asyncio.sleep(0.02)  # the settle runs as a background task
            assert statuses == [200] * 5
            store = guard.controller.budget
            assert store.num_leases("acme") == 0
            assert store.remaining_tokens("acme") >= 100 - 5 * 7 - 1
        await guard.controller.aclose()
    asyncio.run(asyncio.wait_for(go(), 30))


def test_middleware_429_with_retry_after_when_the_bucket_is_empty():
    guard = AdmissionMiddleware(ok_app, config(tenants=[tenant(requests_per_minute=2)]),
                                registry=CollectorRegistry())

    async def go():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
            responses = [await client.post("/v1/completions",
                                           headers={"authorization": "Bearer k-acme"},
                                           json={"model": "m", "prompt": "hi", "max_tokens": 4})
                         for _ in range(3)]
        assert [r.status_code for r in responses] == [200, 200, 429]
        denied = responses[2]
        assert denied.headers["x-kvguard-reason"] == "rpm_limit"
        assert denied.headers["x-should-retry"] == "true" and int(denied.headers["retry-after"]) >= 1
        await guard.controller.aclose()
    asyncio.run(asyncio.wait_for(go(), 30))


def test_proxy_redis_flag_replaces_the_configs_redis_url(tmp_path):
    import argparse

    from guard.config import config_with_upstreams
    from guard.proxy import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    path = tmp_path / "guard.toml"
    path.write_text('redis_url = "redis://10.0.0.1:6379/0"\n'
                    '[[tenants]]\nname = "acme"\napi_key = "k"\nrequests_per_minute = 5\n')
    base = ["--config", str(path), "--upstream", "http://127.0.0.1:8001"]

    def served(argv):  # what `kvguard proxy` builds from its flags
        args = parser.parse_args(argv)
        return config_with_upstreams(args.config, args.upstream, args.state_source, args.redis)

    assert served(base).redis_url == "redis://10.0.0.1:6379/0"
    assert served([*base, "--redis", "redis://127.0.0.1:6390/1"]).redis_url == \
        "redis://127.0.0.1:6390/1"
    with pytest.raises(ValueError, match="redis_url"):
        served([*base, "--redis", "127.0.0.1:6379"])


def test_middleware_lifespan_startup_opens_the_redis_link_before_any_request(redis_server):
    """The budget store reaches Redis (heartbeat written, backend redis) during the lifespan's
    startup, with no request sent: a guard never meets its first requests unconnected."""
    from guard.budget.keys import LIVE_GUARDS_KEY

    async def app(scope, receive, send):  # a wrapped app that runs its own lifespan
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return

    guard = AdmissionMiddleware(app, config(redis_url=redis_server.url,
                                            tenants=[tenant(requests_per_minute=5)]),
                                registry=CollectorRegistry())

    async def go():
        inbox: asyncio.Queue = asyncio.Queue()
        sent: list[str] = []

        async def send(message):
            sent.append(message["type"])

        await inbox.put({"type": "lifespan.startup"})
        task = asyncio.ensure_future(guard({"type": "lifespan"}, inbox.get, send))
        while "lifespan.startup.complete" not in sent:
            await asyncio.sleep(0.01)
        store = guard.controller.budget
        assert store.backend == "redis" and store.ever_reached
        assert redis_server.cli("zscore", LIVE_GUARDS_KEY, store.instance_id).strip()
        await inbox.put({"type": "lifespan.shutdown"})
        await task
        assert sent[-1] == "lifespan.shutdown.complete"
    asyncio.run(asyncio.wait_for(go(), 30))
