"""Open-loop arrivals at a fixed rate against one URL, counting how each request ended.

For the shedding half of ``kvguard bench proxy``: ``num_requests`` non-streaming requests are
sent at ``rate_rps`` (evenly spaced, regardless of how fast answers come back) over a pool of
keep-alive connections; each is recorded as (status, latency). Bounded in count and time: a
request still unanswered ``timeout_s`` after it was sent is recorded as ``timeout``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from chaos.load import few_collections

__all__ = ["ShedResult", "run_open_loop"]


@dataclass
class ShedResult:
    rate_rps: float
    duration_s: float
    num_sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    shed_latencies_s: list[float] = field(default_factory=list)
    send_lag_s: float = 0.0  # how far the last send fell behind its schedule
    examples: dict[str, str] = field(default_factory=dict)  # first body per unexpected status
    wall_s: float = 0.0

    def summary(self) -> dict:
        lat = sorted(self.shed_latencies_s)
        num_shed = len(lat)
        return {
            "offered_rps": self.rate_rps, "sent": self.num_sent,
            "sent_rps": round(self.num_sent / self.duration_s, 1),
            "send_lag_s": round(self.send_lag_s, 3), "statuses": dict(sorted(self.statuses.items())),
            "sheds": num_shed, "sheds_per_s": round(num_shed / self.duration_s, 1),
            "shed_p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
            "shed_p99_ms": round(1000 * lat[min(num_shed - 1, int(0.99 * num_shed))], 2)
            if lat else None,
            "shed_max_ms": round(1000 * lat[-1], 2) if lat else None,
            "unanswered": self.statuses.get("timeout", 0) + self.statuses.get("error", 0),
            "examples": self.examples,
        }


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float,
               result: ShedResult) -> None:
    sent_s = time.perf_counter()
    try:
        async with session.post(url, data=body, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                headers={"content-type": "application/json"}) as response:
            body = await response.read()
            status = str(response.status)
            if response.status not in (200, 429, 503) and status not in result.examples:
                result.examples[status] = body[:300].decode("utf-8", "replace")
    except asyncio.TimeoutError:
        status = "timeout"
    except aiohttp.ClientError:
        status = "error"
    result.statuses[status] = result.statuses.get(status, 0) + 1
    if status in ("429", "503"):
        result.shed_latencies_s.append(time.perf_counter() - sent_s)


async def _run(url: str, body: dict, rate_rps: float, duration_s: float, timeout_s: float,
               max_connections: int) -> ShedResult:
    result = ShedResult(rate_rps, duration_s)
    payload = json.dumps(body).encode()
    num_requests = int(rate_rps * duration_s)
    connector = aiohttp.TCPConnector(limit=max_connections)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        tasks = []
        start_s = time.perf_counter()
        for i in range(num_requests):
            due_s = start_s + i / rate_rps
            delay_s = due_s - time.perf_counter()
            if delay_s > 0.001:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.ensure_future(_one(session, url, payload, timeout_s, result)))
            result.num_sent += 1
        result.send_lag_s = max(0.0, time.perf_counter() - (start_s + (num_requests - 1) / rate_rps))
        await asyncio.gather(*tasks)
        result.wall_s = time.perf_counter() - start_s
    return result


def run_open_loop(url: str, body: dict, *, rate_rps: float, duration_s: float,
                  timeout_s: float = 30.0, max_connections: int = 512) -> ShedResult:
    """Send ``rate_rps × duration_s`` requests open-loop; every one ends within ``timeout_s``."""
    if not rate_rps > 0 or not duration_s > 0 or not timeout_s > 0:
        raise ValueError("rate_rps, duration_s and timeout_s must be > 0")
    with few_collections():
        return asyncio.run(_run(url, body, rate_rps, duration_s, timeout_s, max_connections))
