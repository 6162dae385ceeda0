"""``kvguard bench budget`` on a real redis-server, at a tiny size: what it reports, not how fast."""

from __future__ import annotations

import asyncio

from chaos.bench.budget import measure, render


def test_bench_budget_admits_every_request_and_counts_redis_calls_and_cpu(redis_server):
    result = asyncio.run(measure(redis_server.url, num=40, block=20, concurrency=4, policy="slo"))
    assert result["admitted"] == {"none": 40, "tenant": 40, "memory": 40, "redis": 40}
    assert result["redis_reserves_on_local_share"] == 0
    assert 0 < result["redis_evalsha_per_admitted"] <= 1  # reserves batched, settles carried
    assert all(result["cpu_us"][name] > 0 for name in ("none", "tenant", "memory", "redis"))
    assert result["redis_server_us_per_evalsha"] > 0
    rate = result["rate_rps"]
    assert result["ratio_redis_vs_tenant"] == rate["redis"] / rate["tenant"]
    assert "CPU µs/req" in render(result) and "vs tenant" in render(result)


def test_bench_budget_over_http_serves_the_three_guards_and_reports_each(redis_server):
    from chaos.bench.budget_http import measure_http, render_http

    result = asyncio.run(measure_http(redis_server.url, num=40, block=20, concurrency=4,
                                      policy="slo"))
    assert result["admitted"] == {"none": 40, "memory": 40, "redis": 40}
    assert result["statuses"] == {name: {200: 40} for name in ("none", "memory", "redis")}
    assert 0 < result["redis_evalsha_per_admitted"] <= 1  # the served guard decided in Redis
    assert all(result["rate_rps"][name] > 0 for name in ("none", "memory", "redis"))
    assert "server CPU µs/req" in render_http(result)
