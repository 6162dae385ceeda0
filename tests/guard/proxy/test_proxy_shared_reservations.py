"""Three ``kvguard proxy`` processes sharing one redis-server in front of two sim replicas: a
burst spread over the three admits no more KV than one proxy alone admits, and the engines
never preempt. Real processes and HTTP on loopback, ended by pid."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from chaos.topology import SIM_REPLICA_ARGS, Topology, TopologySpec
from tests.guard.proxy.proxy_helpers import HTTP_SERVER

pytestmark = pytest.mark.slow

# Each replica holds 4 requests of 25 blocks (200 prompt + 200 output tokens); a request runs
# for seconds (time scale 3), far longer than a queued one waits (0.3 s): every request of a
# burst is admitted, or shed, before any admitted one ends.
NUM_BLOCKS, BLOCK_SIZE = 100, 16
REPLICA_ARGS = (*SIM_REPLICA_ARGS, "--num-blocks", str(NUM_BLOCKS), "--block-size",
                str(BLOCK_SIZE), "--max-model-len", "1024", "--time-scale", "3")
# Every request sends the same prompt: the guard's prefix-cache view (and the engines' cache)
# would price the repeats at their few new blocks; this test counts whole requests' KV.
CONFIG = """
policy = "slo"
prefix_cache = "off"
refresh_interval_s = 0.1
max_queue_wait_s = 0.3
[budget]
redis_timeout_s = 1.0   # three proxies and the client share two busy cores: a hang guard only
"""
BODY = {"model": "llama-7b", "prompt": "hello " * 200, "max_tokens": 200}


async def burst(urls: list[str], num: int, during=None) -> list[int]:
    """``num`` simultaneous completions over ``urls``; ``during()`` runs in a thread meanwhile."""
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120.0, limits=limits, trust_env=False) as client:
        async def one(i: int) -> int:
            response = await client.post(urls[i % len(urls)] + "/v1/completions", json=BODY)
            return response.status_code
        tasks = [asyncio.ensure_future(one(i)) for i in range(num)]
        if during is not None:
            await asyncio.to_thread(during)
        return list(await asyncio.gather(*tasks))


def sample_keys(redis_url: str, seen: dict, duration_s: float = 2.0) -> None:
    """Record every ``kvguard:*`` key and its TTL (ms) for ``duration_s``."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            for key in client.scan_iter("kvguard:*"):
                ttl_ms = client.pttl(key)
                if ttl_ms != -2:  # -2: gone since the scan; -1 would be a key without a TTL
                    seen[key] = min(seen.get(key, 1 << 62), ttl_ms)
            time.sleep(0.05)
    finally:
        client.close()


def idle(replica_urls: list[str]) -> bool:
    states = [httpx.get(u + "/kvguard/state", timeout=5.0, trust_env=False).json()
              for u in replica_urls]
    return all(not s["running"] and not s["waiting"] for s in states)


def preemptions(replica_urls: list[str]) -> int:
    return sum(httpx.get(u + "/kvguard/state", timeout=5.0, trust_env=False).json()
               ["num_preemptions"] for u in replica_urls)


def wait_idle(replica_urls: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not idle(replica_urls):
        assert time.monotonic() < deadline, "replicas never went idle"
        time.sleep(0.2)


def test_three_proxies_on_one_redis_admit_no_more_kv_than_one_proxy(tmp_path):
    config = tmp_path / "guard.toml"
    config.write_text(CONFIG)
    spec = TopologySpec(num_replicas=2, replica_args=REPLICA_ARGS, num_proxies=3,
                        proxy_args=("--config", str(config), "--http", HTTP_SERVER), redis=True)
    with Topology(spec) as fleet:
        replicas, proxies = fleet.replica_urls, fleet.proxy_urls
        for url in proxies:  # each proxy has its Redis link up before the burst
            metrics = ""
            deadline = time.monotonic() + 60
            while "kvguard_kv_reservations_shared 1.0" not in metrics:
                assert time.monotonic() < deadline, f"{url} never shared its reservations"
                httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 1},
                           timeout=60.0, trust_env=False)
                metrics = httpx.get(url + "/kvguard/metrics", timeout=5.0, trust_env=False).text
        wait_idle(replicas)
        alone = asyncio.run(burst(proxies[:1], 30))
        wait_idle(replicas)
        seen_keys: dict[bytes, int] = {}
        shared = asyncio.run(burst(proxies, 30, lambda: sample_keys(fleet.redis_url, seen_keys)))
        wait_idle(replicas)
        assert set(alone) <= {200, 503} and set(shared) <= {200, 503}
        per_replica = NUM_BLOCKS // -(-(200 + 200) // BLOCK_SIZE)  # requests whose KV fits
        assert 1 <= alone.count(200) <= 2 * per_replica
        # the three proxies together: no more than the one alone, and no engine preempted
        assert shared.count(200) <= alone.count(200), (alone.count(200), shared.count(200))
        assert preemptions(replicas) == 0
        # while requests were pending the proxies' keys were in Redis, each with a TTL
        assert seen_keys and all(ttl_ms > 0 for ttl_ms in seen_keys.values()), seen_keys
