"""``kvguard bench budget``: the guard's request rate with Redis budgets, in-memory budgets and
none, side by side in one process and one run, and Redis calls per admitted request.

The same trivial completion app (``chaos.bench.guard``) is wrapped four times in
:class:`~guard.middleware.AdmissionMiddleware`: no tenant and no budget (``none``); the
budgets' tenant, matched by its API key, without limits (``tenant``: so the budget's own cost
is told apart from identifying the tenant, a SHA-256 of the key per request); a tenant budget
in the in-memory store; the same budget in Redis (a ``redis-server`` the bench starts on a free loopback
port and kills by pid, or ``--redis URL``). Blocks of requests alternate between the four so
drift hits all equally; ``--concurrency`` requests are in flight at once (Redis round trips
overlap, as they do in a server). The budget is far above what the run uses: nothing is denied,
every request pays a reserve and a settle.

Redis calls are counted by the server (``INFO commandstats`` before and after the Redis blocks):
EVALSHA calls (reserve, settle batches, heartbeats) and all commands, per admitted request, and
the server's own time per EVALSHA (``usec_per_call``).

Each block's thread CPU time is recorded too (``cpu_us``: CPU µs per request, the median over
blocks): wall time less CPU time is what the guard spent waiting (for Redis, in the Redis
variant) or descheduled; on a shared machine CPU time moves far less from run to run.
Targets: ≤ 1 Redis call per admitted request; Redis budgets ≥ 0.8× the no-budget rate.

``--http`` also serves the three guards over loopback HTTP and drives them as clients would
(:mod:`chaos.bench.budget_http`); both results are reported, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from chaos.bench.budget_http import _calls, _guard, measure_http, render_http, stop_child

__all__ = ["configure", "run", "measure"]



def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=6000, help="requests per variant")
    parser.add_argument("--block", type=int, default=500, help="requests per alternating block")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--policy", default="slo", help="admission policy (default: slo)")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="use this Redis instead of starting a redis-server (its keys under "
                             "kvguard:{bench}: are written)")
    parser.add_argument("--redis-timeout-s", type=float, default=0.05,
                        help="budget.redis_timeout_s of the Redis variant (default 0.05)")
    parser.add_argument("--http", action="store_true",
                        help="also serve the three guards over loopback HTTP (kvguard's server, "
                             "one process each) and drive them as clients would")
    parser.add_argument("--http-requests", type=int, default=6000,
                        help="requests per variant over HTTP (with --http)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def run(args: argparse.Namespace) -> int:
    if min(args.requests, args.block, args.concurrency) < 1:
        raise ValueError("--requests, --block and --concurrency must be >= 1")

    server = None if args.redis else _RedisServer.start()
    try:
        url = args.redis or server.url
        results = asyncio.run(measure(url, args.requests, args.block, args.concurrency,
                                      args.policy, args.redis_timeout_s))
        if args.http:
            results["http"] = asyncio.run(measure_http(
                url, args.http_requests, args.block, args.concurrency, args.policy,
                args.redis_timeout_s))
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(render(results))
        if "http" in results:
            print(render_http(results["http"]))
    return 0




async def _drive(app, num: int, concurrency: int) -> tuple[float, int, float]:
    """Seconds to serve ``num`` requests ``concurrency`` at a time, how many got 200, and the
    thread CPU seconds it took."""
    from chaos.bench.guard import _BODY, _SCOPE

    message = {"type": "http.request", "body": _BODY, "more_body": False}
    ok = 0

    async def receive() -> dict:
        return message

    async def worker(count: int) -> None:
        nonlocal ok
        status = []

        async def send(m: dict) -> None:
            if m["type"] == "http.response.start":
                status.append(m["status"])
        for _ in range(count):
            status.clear()
            await app(_SCOPE, receive, send)
            ok += status == [200]
            await asyncio.sleep(0)  # let settles and other background tasks run, as a server would

    shares = [num // concurrency + (i < num % concurrency) for i in range(concurrency)]
    cpu_start, start = time.thread_time(), time.perf_counter()
    await asyncio.gather(*(worker(n) for n in shares if n))
    return time.perf_counter() - start, ok, time.thread_time() - cpu_start


async def measure(redis_url: str, num: int, block: int, concurrency: int, policy: str,
                  redis_timeout_s: float = 0.05) -> dict:
    import redis.asyncio as aioredis

    guards = {"none": _guard(policy, None, None), "tenant": _guard(policy, "tenant", None),
              "memory": _guard(policy, "memory", None),
              "redis": _guard(policy, "redis", redis_url, redis_timeout_s)}
    stats = aioredis.Redis.from_url(redis_url)
    for app in guards.values():  # warm-up: connections, scripts, learning, first snapshot
        await _drive(app, min(block, num), concurrency)
    await _until_on_redis(guards["redis"])
    seconds = dict.fromkeys(guards, 0.0)
    admitted = dict.fromkeys(guards, 0)
    cpu_us: dict[str, list[float]] = {name: [] for name in guards}  # per request, per block
    before = await stats.info("commandstats")
    local_before = guards["redis"].controller.budget.num_local_reserves
    for done in range(0, num, block):
        n = min(block, num - done)
        for name, app in guards.items():
            took, ok, cpu_s = await _drive(app, n, concurrency)
            seconds[name] += took
            admitted[name] += ok
            cpu_us[name].append(1e6 * cpu_s / n)
    await asyncio.sleep(0.1)  # the last settle batch
    after = await stats.info("commandstats")
    local = guards["redis"].controller.budget.num_local_reserves - local_before
    await stats.aclose()
    for app in guards.values():
        await app.aclose()
    evalsha = _calls(after, "evalsha") - _calls(before, "evalsha")
    server_us = _usec(after, "evalsha") - _usec(before, "evalsha")
    # commands run inside scripts are counted too: only these come from the client
    client_side = ("evalsha", "eval", "ping", "hello", "script|load", "client|setinfo")
    total = sum(_calls(after, c) - _calls(before, c) for c in client_side)
    rates = {name: num / seconds[name] for name in guards}
    return {"requests_per_variant": num, "concurrency": concurrency, "policy": policy,
            "rate_rps": rates, "admitted": admitted,
            "cpu_us": {name: statistics.median(cpu_us[name]) for name in guards},
            "ratio_redis_vs_none": rates["redis"] / rates["none"],
            "ratio_memory_vs_none": rates["memory"] / rates["none"],
            # what the budget alone costs: the same tenant, matched by its API key, no limits
            "ratio_redis_vs_tenant": rates["redis"] / rates["tenant"],
            "ratio_memory_vs_tenant": rates["memory"] / rates["tenant"],
            "redis_evalsha_per_admitted": evalsha / max(1, admitted["redis"]),
            "redis_commands_per_admitted": total / max(1, admitted["redis"]),
            "redis_server_us_per_evalsha": server_us / max(1, evalsha),
            "redis_timeout_s": redis_timeout_s, "redis_reserves_on_local_share": local}


async def _until_on_redis(app, timeout_s: float = 10.0) -> None:
    store = app.controller.budget
    deadline = time.monotonic() + timeout_s
    while store.backend != "redis":
        if time.monotonic() > deadline:
            raise RuntimeError("the guard never reached Redis")
        await asyncio.sleep(0.05)


def _commands(info: dict) -> list[str]:
    return [k.removeprefix("cmdstat_") for k in info if k.startswith("cmdstat_")]




def _usec(info: dict, command: str) -> int:
    return int(info.get(f"cmdstat_{command}", {}).get("usec", 0))


def render(r: dict) -> str:
    rate = r["rate_rps"]
    lines = [f"kvguard bench budget — {r['requests_per_variant']} requests per variant, "
             f"{r['concurrency']} in flight, policy {r['policy']}",
             "variant        req/s   admitted   vs none  vs tenant   CPU µs/req"]
    for name in ("none", "tenant", "memory", "redis"):
        lines.append(f"{name:<10} {rate[name]:>9.0f} {r['admitted'][name]:>10} "
                     f"{rate[name] / rate['none']:>8.2f}× {rate[name] / rate['tenant']:>9.2f}× "
                     f"{r['cpu_us'][name]:>12.1f}")
    lines.append("(tenant: the budgets' tenant matched by its API key, without limits: the "
                 "'vs tenant' column is what the budget alone costs)")
    lines.append(f"Redis EVALSHA per admitted request: {r['redis_evalsha_per_admitted']:.2f} "
                 f"(all client commands: {r['redis_commands_per_admitted']:.2f}); target ≤ 1")
    lines.append(f"Redis server time per EVALSHA: {r['redis_server_us_per_evalsha']:.0f} µs")
    lines.append(f"Redis variant: timeout {r['redis_timeout_s'] * 1000:.0f} ms, "
                 f"{r['redis_reserves_on_local_share']} reserves fell back to the local share")
    return "\n".join(lines)




class _RedisServer:
    """A throwaway redis-server on a free loopback port (no persistence), stopped by pid."""

    def __init__(self, proc: subprocess.Popen, port: int, workdir: str) -> None:
        self.proc, self.port, self.workdir = proc, port, workdir

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls) -> _RedisServer:
        if shutil.which("redis-server") is None:
            raise ValueError("redis-server not found on PATH: install it or pass --redis URL")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        workdir = tempfile.mkdtemp(prefix="kvguard-bench-redis-")
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", workdir],
                                stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return cls(proc, port, workdir)
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        stop_child(self.proc)
        shutil.rmtree(self.workdir, ignore_errors=True)
