"""Three ``kvguard proxy --redis URL`` processes in front of one upstream share one tenant budget.
Real processes, real HTTP on loopback, a real redis-server; everything ended by pid."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis_servers import RedisServer

from chaos.child import ChildProcess
from chaos.topology import http_health
from guard.budget.keys import tenant_keys

pytestmark = pytest.mark.slow

UPSTREAM = Path(__file__).parents[1] / "proxy" / "upstream_server.py"
CONFIG = """
policy = "always-admit"
[budget]
redis_timeout_s = 1.0   # three proxies and the client share two busy cores: a hang guard only
heartbeat_s = 0.2
[[tenants]]
name = "acme"
api_key = "k-acme"
requests_per_minute = 30
"""


def proxy(upstream: str, config: Path, redis_url: str) -> ChildProcess:
    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "guard.cli", "proxy", "--upstream", upstream,
                "--state-source", "none", "--config", str(config), "--redis", redis_url,
                "--host", "127.0.0.1", "--port", str(port)]
    return ChildProcess("proxy", argv, http_health,
                        ready_pattern=r"kvguard proxy listening on (\S+)")


async def burst(urls: list[str], num: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60.0, trust_env=False,
                                 limits=httpx.Limits(max_connections=num)) as client:
        async def one(i: int) -> int:
            response = await client.post(urls[i % len(urls)] + "/v1/completions",
                                         headers={"authorization": "Bearer k-acme"},
                                         json={"model": "fake-model", "prompt": "hi",
                                               "max_tokens": 4})
            return response.status_code
        return list(await asyncio.gather(*(one(i) for i in range(num))))


def on_redis(url: str, timeout_s: float = 60.0) -> None:
    """One request of the budgeted tenant (starting the proxy's Redis link), then wait until
    the proxy reports Redis as its budget backend."""
    httpx.post(url + "/v1/completions", headers={"authorization": "Bearer k-acme"},
               json={"model": "fake-model", "prompt": "hi", "max_tokens": 1}, timeout=60.0,
               trust_env=False)
    deadline = time.monotonic() + timeout_s
    while 'kvguard_budget_backend{backend="redis"} 1.0' not in httpx.get(
            url + "/kvguard/metrics", timeout=5.0, trust_env=False).text:
        assert time.monotonic() < deadline, f"{url} never reached Redis"
        time.sleep(0.1)


def test_three_proxies_with_redis_admit_one_budget(tmp_path):
    server = RedisServer().start()
    config = tmp_path / "guard.toml"
    config.write_text(CONFIG)
    upstream = ChildProcess("upstream", lambda port: [sys.executable, str(UPSTREAM), "ok",
                                                      "fake-model"],
                            http_health, ready_pattern=r"upstream listening on (\S+)")
    children = [upstream]
    try:
        upstream.start()
        for _ in range(3):
            children.append(proxy(upstream.url, config, server.url).start())
        start_s = time.monotonic()
        for child in children[1:]:  # each on Redis before the burst (its first request starts
            on_redis(child.url)     # the link; a slow first connect would decide locally)
        statuses = asyncio.run(burst([c.url for c in children[1:]], 90))
        elapsed_s = time.monotonic() - start_s
        assert set(statuses) <= {200, 429}
        # 30 a minute, less the 3 warm-up requests, plus what refilled meanwhile
        assert 25 <= statuses.count(200) <= 27 + int(30 * elapsed_s / 60) + 1
        assert server.cli("exists", tenant_keys("acme")[0]).strip() == "1"  # decided in Redis
    finally:
        for child in reversed(children):
            child.terminate()
        server.kill()
