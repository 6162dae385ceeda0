"""``kvguard bench budget --http``: the same three guards as the in-process bench, served over
loopback HTTP — the guard as users run it.

Each variant (no budget, in-memory budget, Redis budget: :func:`chaos.bench.budget._guard`) is
the middleware over the trivial completion app, served by kvguard's own HTTP/1.1 server
(:mod:`serving.h1server`, the ASGI lifespan on: the budget store connects at start-up) in its
own child process (``python -m chaos.bench.budget_http --serve VARIANT``), killed by pid at the
end. This process is the client: ``concurrency`` keep-alive connections per server, each one
request at a time (closed loop), in blocks that alternate between the three servers so drift
hits all equally. Per block: wall time, and the server child's CPU time (``/proc/PID/stat``
user + system, ``CPU µs/req``: what the server process spent per request, HTTP included).

The client shares the machine with the servers; it costs the same for all three variants, so
read the ratios, and the server CPU per request beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from chaos.bench.guard import _BODY

_API_KEY = "sk-bench"
_HUGE = 10**12

__all__ = ["measure_http", "VARIANTS"]

VARIANTS = ("none", "memory", "redis")
_REQUEST = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
            b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)
_READY = re.compile(rb"budget bench serving on (\d+)")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class _Connection(asyncio.Protocol):
    """One keep-alive connection: :meth:`post` writes a request and waits for its response."""

    def __init__(self) -> None:
        self._buffer = b""
        self._waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0 or self._waiter is None:
            return
        head = self._buffer[:head_end]
        match = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
        length = int(match.group(1)) if match else 0
        end = head_end + 4 + length
        if len(self._buffer) < end:
            return
        self._buffer = self._buffer[end:]
        waiter, self._waiter = self._waiter, None
        if not waiter.done():
            waiter.set_result(int(head.split(b" ", 2)[1]))

    def connection_lost(self, exc) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError("bench server closed the connection"))

    async def post(self) -> int:
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(_REQUEST)
        return await self._waiter


class _Server:
    """One variant's server child, started by :meth:`start` and stopped by pid."""

    def __init__(self, variant: str, redis_url: str, policy: str, timeout_s: float) -> None:
        self.variant = variant
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chaos.bench.budget_http", "--serve", variant,
             "--redis", redis_url, "--policy", policy, "--redis-timeout-s", str(timeout_s)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.port = 0

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        seen = b""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen += line
            match = _READY.search(line)
            if match:
                self.port = int(match.group(1))
                return
        raise RuntimeError(f"bench server {self.variant} did not start: {seen[-500:]!r}")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime + stime

    def stop(self) -> None:
        stop_child(self.proc)


async def _drive(connections: list[_Connection], num: int,
                 statuses: Counter | None = None) -> tuple[float, int]:
    """Seconds for ``num`` requests over ``connections`` (one at a time on each), and 200s."""
    ok = 0

    async def worker(connection: _Connection, count: int) -> None:
        nonlocal ok
        for _ in range(count):
            status = await connection.post()
            ok += status == 200
            if statuses is not None:
                statuses[status] += 1

    n = len(connections)
    shares = [num // n + (i < num % n) for i in range(n)]
    start = time.perf_counter()
    await asyncio.gather(*(worker(c, k) for c, k in zip(connections, shares, strict=True) if k))
    return time.perf_counter() - start, ok


async def measure_http(redis_url: str, num: int, block: int, concurrency: int, policy: str,
                       redis_timeout_s: float = 0.05) -> dict:
    """Rates, admitted counts and server CPU per request of the three served variants."""
    import redis.asyncio as aioredis

    servers = {v: _Server(v, redis_url, policy, redis_timeout_s) for v in VARIANTS}
    try:
        for server in servers.values():
            server.wait_ready()
        loop = asyncio.get_running_loop()
        pools: dict[str, list[_Connection]] = {}
        for name, server in servers.items():
            pools[name] = []
            for _ in range(concurrency):
                _, protocol = await loop.create_connection(_Connection, "127.0.0.1", server.port)
                pools[name].append(protocol)
        for name in VARIANTS:  # warm-up
            await _drive(pools[name], min(block, num))
        stats = aioredis.Redis.from_url(redis_url)
        before = await stats.info("commandstats")
        seconds = dict.fromkeys(VARIANTS, 0.0)
        admitted = dict.fromkeys(VARIANTS, 0)
        cpu_s = dict.fromkeys(VARIANTS, 0.0)
        statuses: dict[str, Counter] = {name: Counter() for name in VARIANTS}
        for done in range(0, num, block):
            n = min(block, num - done)
            for name in VARIANTS:
                cpu_before = servers[name].cpu_s()
                took, ok = await _drive(pools[name], n, statuses[name])
                cpu_s[name] += servers[name].cpu_s() - cpu_before
                seconds[name] += took
                admitted[name] += ok
        await asyncio.sleep(0.1)  # the last settle batch
        after = await stats.info("commandstats")
        await stats.aclose()
        for pool in pools.values():
            for connection in pool:
                connection.transport.close()
    finally:
        for server in servers.values():
            server.stop()
    rates = {name: num / seconds[name] for name in VARIANTS}
    return {"requests_per_variant": num, "concurrency": concurrency, "policy": policy,
            "rate_rps": rates, "admitted": admitted,
            "statuses": {name: dict(sorted(statuses[name].items())) for name in VARIANTS},
            "server_cpu_us": {name: 1e6 * cpu_s[name] / num for name in VARIANTS},
            "ratio_redis_vs_none": rates["redis"] / rates["none"],
            "ratio_memory_vs_none": rates["memory"] / rates["none"],
            "redis_evalsha_per_admitted":
                (_calls(after, "evalsha") - _calls(before, "evalsha")) / max(1, admitted["redis"])}


def render_http(r: dict) -> str:
    rate = r["rate_rps"]
    lines = [f"over loopback HTTP (kvguard's server, one process per variant) — "
             f"{r['requests_per_variant']} requests per variant, {r['concurrency']} connections",
             "variant        req/s   admitted   vs none   server CPU µs/req"]
    for name in VARIANTS:
        lines.append(f"{name:<10} {rate[name]:>9.0f} {r['admitted'][name]:>10} "
                     f"{rate[name] / rate['none']:>8.2f}× {r['server_cpu_us'][name]:>19.1f}")
    lines.append(f"Redis EVALSHA per admitted request: {r['redis_evalsha_per_admitted']:.2f}")
    return "\n".join(lines)


def _serve(variant: str, redis_url: str, policy: str, timeout_s: float) -> int:
    """The child: one variant's guard on kvguard's HTTP/1.1 server, lifespan on."""
    import socket

    from serving.h1server import H1Server, run
    from serving.limited_protocol import ConnectionTable
    from serving.server_limits import ServerLimits

    app = _guard(policy, None if variant == "none" else variant,
                 redis_url if variant == "redis" else None, timeout_s)
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    server = H1Server(app, ConnectionTable(ServerLimits()), graceful_timeout_s=1.0)
    return 0 if run(server, [sock], ready_line=f"budget bench serving on {port}") else 1


def _guard(policy: str, budget: str | None, redis_url: str | None, timeout_s: float = 0.05):
    from prometheus_client import CollectorRegistry

    from chaos.bench.guard import trivial_app
    from guard.config import GuardConfig
    from guard.middleware import AdmissionMiddleware

    data: dict[str, Any] = {"policy": policy}
    if budget == "tenant":  # the same tenant, matched by its API key, without any limit
        data["tenants"] = [{"name": "bench", "api_key": _API_KEY}]
    elif budget is not None:
        data["tenants"] = [{"name": "bench", "api_key": _API_KEY, "tokens_per_minute": _HUGE,
                            "requests_per_minute": _HUGE}]
    if budget == "redis":
        data["redis_url"] = redis_url
        data["budget"] = {"redis_timeout_s": timeout_s}
    return AdmissionMiddleware(trivial_app, GuardConfig.from_dict(data),
                               registry=CollectorRegistry())

def _calls(info: dict, command: str) -> int:
    return int(info.get(f"cmdstat_{command}", {}).get("calls", 0))

def stop_child(proc: subprocess.Popen) -> None:
    """End a child this bench started, by its pid: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":  # the server child of measure_http
    parser = argparse.ArgumentParser(description="a served variant of kvguard bench budget")
    parser.add_argument("--serve", choices=VARIANTS, required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--policy", default="slo")
    parser.add_argument("--redis-timeout-s", type=float, default=0.05)
    ns = parser.parse_args()
    sys.exit(_serve(ns.serve, ns.redis, ns.policy, ns.redis_timeout_s))
