"""Shared polling measured: N proxies in front of a state-only fleet, with and without
``[proxy] shared_polling_ttl_s``, all in one process with a real redis-server.

    python -m chaos.bench.shared_polling --redis redis://127.0.0.1:6379/0 \\
        --replicas 64 --proxies 2 --seconds 5

Per mode: the replicas' ``/kvguard/state`` answers per second (counted at the replicas), the
process's CPU seconds per second (the fleet, the proxies and their pollers together), and
with sharing the age of the snapshots the proxies read from Redis (p50, p99, max, sampled
every 50 ms over the replicas a proxy does not poll), then the time from one proxy stopping
without leaving (heartbeat and poller cancelled) until the others poll all of its shard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from chaos.state_fleet import StateFleet, StateFleetConfig, _ReplicaApp
from guard.config import GuardConfig
from guard.proxy.app import ProxyApp


def _proxy(redis_url: str, urls: dict[str, str], ttl_s: float | None,
           refresh_s: float, state_source: str) -> ProxyApp:
    proxy = {} if ttl_s is None else {"shared_polling_ttl_s": ttl_s}
    return ProxyApp(GuardConfig.from_dict({
        "refresh_interval_s": refresh_s, "allow_anonymous": True, "redis_url": redis_url,
        "proxy": proxy,
        "replicas": [{"replica_id": rid, "url": url, "state_source": state_source}
                     for rid, url in sorted(urls.items())]}))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run_mode(args, ttl_s: float | None, counts: list[int]) -> dict:
    fleet = StateFleet(StateFleetConfig(tick_s=0.01))
    await fleet.start(args.replicas)
    proxies = [_proxy(args.redis, fleet.urls, ttl_s, args.refresh_s, args.state_source)
               for _ in range(args.proxies)]
    out: dict = {"mode": "shared" if ttl_s else "each polls all"}
    try:
        for proxy in proxies:
            await proxy.start()
        await asyncio.sleep(1.0 + (ttl_s or 0))  # lists agree, rounds settle
        counts[0] = 0
        cpu0, wall0 = time.process_time(), time.monotonic()
        ages: list[float] = []
        while time.monotonic() - wall0 < args.seconds:
            await asyncio.sleep(0.05)
            if ttl_s:
                for proxy in proxies:
                    for source in proxy._sources.values():
                        if source.polled_by != proxy.shards.decider_id and source.age_s is not None:
                            ages.append(source.age_s)
        wall = time.monotonic() - wall0
        out["state_answers_per_s"] = round(counts[0] / wall, 1)
        out["cpu_s_per_s"] = round((time.process_time() - cpu0) / wall, 3)
        if ttl_s:
            out["snapshot_age_ms"] = {"p50": round(1000 * _pct(ages, 0.5), 1),
                                      "p99": round(1000 * _pct(ages, 0.99), 1),
                                      "max": round(1000 * max(ages), 1),
                                      "mean": round(1000 * statistics.fmean(ages), 1)}
            a, b = proxies[0], proxies[1]
            shard = [rid for rid, url in fleet.urls.items()
                     if a.shards.owner(url) == b.shards.decider_id]
            b.shards._task.cancel()
            await b.controller.aclose()
            survivors = [p for p in proxies if p is not b]

            def polled(rid: str) -> int:
                return sum(p._sources[rid].num_polls for p in survivors)

            polls = {rid: polled(rid) for rid in shard}
            died_s = time.monotonic()
            while not all(polled(rid) > polls[rid] for rid in shard):
                if time.monotonic() - died_s > 10 * ttl_s:
                    raise RuntimeError("the shard was not taken over within 10 TTLs")
                await asyncio.sleep(0.01)
            out["takeover_s"] = round(time.monotonic() - died_s, 3)
            out["dead_shard_size"] = len(shard)
    finally:
        for proxy in proxies:
            await proxy.aclose()
        await fleet.stop()
    return out


async def main_async(args) -> list[dict]:
    counts = [0]
    state = _ReplicaApp._state

    async def counted(self, scope, send):
        counts[0] += 1
        await state(self, scope, send)

    _ReplicaApp._state = counted  # the fleet's /kvguard/state answers, counted
    try:
        return [await run_mode(args, None, counts),
                await run_mode(args, args.ttl_s, counts)]
    finally:
        _ReplicaApp._state = state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True, help="a redis URL (required)")
    parser.add_argument("--replicas", type=int, default=64, help="replicas (default: 64)")
    parser.add_argument("--proxies", type=int, default=2, help="proxies, >= 2 (default: 2)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="measured seconds per mode (default: 5)")
    parser.add_argument("--refresh-s", type=float, default=0.1,
                        help="refresh_interval_s (default: 0.1)")
    parser.add_argument("--ttl-s", type=float, default=2.0,
                        help="shared_polling_ttl_s (default: 2.0)")
    parser.add_argument("--state-source", default="kvguard",
                        help="the replicas' state_source (default: kvguard)")
    args = parser.parse_args()
    if args.proxies < 2:
        parser.error("--proxies: at least 2")
    for row in asyncio.run(asyncio.wait_for(main_async(args), 4 * args.seconds + 60)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
