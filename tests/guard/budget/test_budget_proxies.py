"""Three ``kvguard proxy --redis URL`` processes in front of one upstream share one tenant budget.
Real processes, real HTTP on loopback, a real redis-server; everything ended by pid."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis_servers import RedisServer, free_port

from chaos.child import ChildProcess
from chaos.topology import http_health
from guard.budget.keys import LIVE_GUARDS_KEY, tenant_keys

pytestmark = pytest.mark.slow

UPSTREAM = Path(__file__).parents[1] / "proxy" / "upstream_server.py"
CONFIG = """
policy = "always-admit"
[budget]
redis_timeout_s = 1.0   # three proxies and the client share two busy cores: a hang guard only
heartbeat_s = 0.2
expected_guards = 3     # the start-up share before Redis was reached: 30 ÷ 3
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


def backend(url: str) -> str | None:
    """The budget backend the proxy reports on /kvguard/metrics (None: not reported yet)."""
    text = httpx.get(url + "/kvguard/metrics", timeout=5.0, trust_env=False).text
    for name in ("redis", "local"):
        if f'kvguard_budget_backend{{backend="{name}"}} 1.0' in text:
            return name
    return None


def on_redis(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the proxy reports Redis as its budget backend (it connects at start-up)."""
    deadline = time.monotonic() + timeout_s
    while backend(url) != "redis":
        assert time.monotonic() < deadline, f"{url} never reached Redis"
        time.sleep(0.1)


def start_all(tmp_path: Path, redis_url: str, num_proxies: int = 3,
              config: str = CONFIG) -> list[ChildProcess]:
    """The upstream, then ``num_proxies`` proxies on ``redis_url`` (children[0]: the upstream)."""
    path = tmp_path / "guard.toml"
    path.write_text(config)
    upstream = ChildProcess("upstream", lambda port: [sys.executable, str(UPSTREAM), "ok",
                                                      "fake-model"],
                            http_health, ready_pattern=r"upstream listening on (\S+)")
    children = [upstream]
    try:
        upstream.start()
        for _ in range(num_proxies):
            children.append(proxy(upstream.url, path, redis_url).start())
    except BaseException:
        stop_all(children)
        raise
    return children


def stop_all(children: list[ChildProcess]) -> None:
    for child in reversed(children):
        child.terminate()


def test_three_proxies_with_redis_admit_one_budget(tmp_path):
    server = RedisServer().start()
    children = []
    try:
        children = start_all(tmp_path, server.url)
        start_s = time.monotonic()
        for child in children[1:]:  # each on Redis before the burst (it connects at start-up;
            on_redis(child.url)     # a slow first connect would decide on its start-up share)
        statuses = asyncio.run(burst([c.url for c in children[1:]], 90))
        elapsed_s = time.monotonic() - start_s
        assert set(statuses) <= {200, 429}
        # 30 a minute, plus what refilled meanwhile
        assert 30 <= statuses.count(200) <= 30 + int(30 * elapsed_s / 60) + 1
        assert server.cli("exists", tenant_keys("acme")[0]).strip() == "1"  # decided in Redis
    finally:
        stop_all(children)
        server.kill()


def test_a_proxy_reaches_redis_at_start_up_before_its_first_request(tmp_path):
    server = RedisServer().start()
    children = []
    try:
        children = start_all(tmp_path, server.url, num_proxies=1)
        # no request sent yet: the heartbeat is already in Redis, the backend already Redis
        assert int(server.cli("zcard", LIVE_GUARDS_KEY)) == 1
        assert backend(children[1].url) == "redis"
    finally:
        stop_all(children)
        server.kill()


def test_proxies_started_without_redis_admit_one_budget_and_charge_it_when_redis_comes(tmp_path):
    """Redis absent at start-up: the proxies start anyway (local, retrying), each on the
    start-up share (30 ÷ expected_guards 3), so a burst over all three admits one budget, not
    three; when Redis starts, each charges what it admitted and the shared bucket is spent."""
    server = RedisServer(port=free_port())  # not running yet
    children = []
    try:
        children = start_all(tmp_path, server.url)
        start_s = time.monotonic()
        assert {backend(c.url) for c in children[1:]} == {"local"}
        statuses = asyncio.run(burst([c.url for c in children[1:]], 90))
        refill = int(30 * (time.monotonic() - start_s) / 60) + 1
        assert set(statuses) <= {200, 429}
        admitted = statuses.count(200)
        assert 30 <= admitted <= 30 + refill  # one budget across three proxies, not 30 each
        server.start()
        for child in children[1:]:
            on_redis(child.url)
        left = float(server.cli("hget", tenant_keys("acme")[0], "rl"))
        assert left <= 30 - admitted + refill  # every proxy's local admissions charged
    finally:
        stop_all(children)
        server.kill()


def _seconds(duration: str) -> float:
    """OpenAI's duration text (``20ms``, ``1.5s``, ``6m0s``) in seconds."""
    if duration.endswith("ms"):
        return float(duration[:-2]) / 1000
    minutes, _, seconds = duration.removesuffix("s").rpartition("m")
    return 60 * float(minutes or 0) + float(seconds)


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_admitted_responses_say_what_is_left_of_the_budget(tmp_path, store):
    """OpenAI's x-ratelimit-remaining-* and -reset-* on each admitted response of a budgeted
    tenant, from the embedded store or from Redis: one request less each time (30 a minute
    refill one every 2 s, hence "at most"), reset = until the bucket is full again."""
    server = RedisServer().start() if store == "redis" else None
    config = CONFIG.replace("requests_per_minute = 30",
                            "requests_per_minute = 30\ntokens_per_minute = 100000")
    children = []
    try:
        if server is not None:
            children = start_all(tmp_path, server.url, num_proxies=1, config=config)
            on_redis(children[1].url)
        else:
            children = start_all(tmp_path, "", num_proxies=0, config=config)
            path = tmp_path / "guard.toml"
            embedded = ChildProcess("proxy", lambda port: [
                sys.executable, "-m", "guard.cli", "proxy", "--upstream", children[0].url,
                "--state-source", "none", "--config", str(path), "--host", "127.0.0.1",
                "--port", str(port)], http_health,
                ready_pattern=r"kvguard proxy listening on (\S+)")
            children.append(embedded.start())
        remaining = []
        for _ in range(3):
            answer = httpx.post(children[1].url + "/v1/completions",
                                headers={"authorization": "Bearer k-acme"},
                                json={"model": "fake-model", "prompt": "hi", "max_tokens": 4},
                                timeout=30.0, trust_env=False)
            assert answer.status_code == 200, answer.text
            headers = answer.headers
            assert headers["x-ratelimit-limit-requests"] == "30"
            remaining.append((int(headers["x-ratelimit-remaining-requests"]),
                              int(headers["x-ratelimit-remaining-tokens"])))
            assert 0 < _seconds(headers["x-ratelimit-reset-requests"]) <= 60.0
            # a few tokens at 100,000 a minute come back within milliseconds
            assert 0 <= _seconds(headers["x-ratelimit-reset-tokens"]) <= 60.0
        assert remaining[0][0] == 29 and 99_900 <= remaining[0][1] <= 100_000
        assert [r for r, _ in remaining] == sorted((r for r, _ in remaining), reverse=True)
        assert remaining[2][0] <= 28
    finally:
        stop_all(children)
        if server is not None:
            server.kill()
