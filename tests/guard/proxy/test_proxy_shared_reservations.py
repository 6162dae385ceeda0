"""Three ``kvguard proxy`` processes sharing one redis-server in front of two sim replicas: a
burst spread over the three admits no more KV than one proxy alone admits, and the engines
never preempt. Real processes and HTTP on loopback, ended by pid."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from chaos.topology import SIM_REPLICA_ARGS, Topology, TopologySpec

pytestmark = pytest.mark.slow

# Each replica holds 4 requests of 25 blocks (200 prompt + 200 output tokens); a request runs
# for seconds (time scale 3), far longer than a queued one waits (0.3 s): every request of a
# burst is admitted, or shed, before any admitted one ends.
NUM_BLOCKS, BLOCK_SIZE = 100, 16
REPLICA_ARGS = (*SIM_REPLICA_ARGS, "--num-blocks", str(NUM_BLOCKS), "--block-size",
                str(BLOCK_SIZE), "--max-model-len", "1024", "--time-scale", "3")
CONFIG = """
policy = "slo"
refresh_interval_s = 0.1
max_queue_wait_s = 0.3
[budget]
redis_timeout_s = 1.0   # three proxies and the client share two busy cores: a hang guard only
"""
BODY = {"model": "llama-7b", "prompt": "hello " * 200, "max_tokens": 200}


async def burst(urls: list[str], num: int) -> list[int]:
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120.0, limits=limits, trust_env=False) as client:
        async def one(i: int) -> int:
            response = await client.post(urls[i % len(urls)] + "/v1/completions", json=BODY)
            return response.status_code
        return list(await asyncio.gather(*(one(i) for i in range(num))))


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
                        proxy_args=("--config", str(config)), redis=True)
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
        shared = asyncio.run(burst(proxies, 30))
        wait_idle(replicas)
        assert set(alone) <= {200, 503} and set(shared) <= {200, 503}
        per_replica = NUM_BLOCKS // -(-(200 + 200) // BLOCK_SIZE)  # requests whose KV fits
        assert 1 <= alone.count(200) <= 2 * per_replica
        # the three proxies together: no more than the one alone, and no engine preempted
        assert shared.count(200) <= alone.count(200)
        assert preemptions(replicas) == 0
