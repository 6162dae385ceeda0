"""Instructions per request of ``kvguard bench budget``'s in-process variants, counted by
valgrind's callgrind: a contention-proof companion to the bench's rates (they move with other
load on the machine; the instruction count barely does).

    python scripts/budget_instructions.py CHECKOUT [CHECKOUT ...] [--variants none,tenant,memory,redis]

For each checkout (a kvguard source tree, e.g. ``git worktree add /tmp/old 2066137``) the bench's
trivial app is wrapped in the guard (``slo``) as the bench wraps it — ``none``: no tenants;
``tenant``: the bench's tenant without limits (what matching an API key costs); ``memory``: its
budget in the in-memory store; ``redis``: in Redis (one redis-server on a free loopback port,
started here and stopped by pid) — and driven 16 requests at a time for 200 and for 2,200
requests under callgrind; the difference over the 2,000 extra requests is the per-request count.
After a warm-up the guard's background tasks are stopped and its clock (and the grant pool's) is
a counter (+10 µs per read), so held grants age per request, not per second of valgrind's slow
run. Redis calls are real: the settle flush timer (``settle_delay_s``) still runs on real time,
so under valgrind it fires after fewer requests than natively, and the ``redis`` count includes
more settle calls per request than a native run makes. A few minutes per checkout and variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from callgrind_count import callgrind_instructions

_RUN = r'''
import asyncio, itertools, sys
from prometheus_client import CollectorRegistry
from chaos.bench.guard import trivial_app
from chaos.bench.budget import _API_KEY, _HUGE, _drive
from guard.config import GuardConfig
from guard.middleware import AdmissionMiddleware
num, which, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ticks = itertools.count()
clock = lambda: 1000.0 + next(ticks) * 1e-5
async def main():
    data = {"policy": "slo"}
    if which == "tenant":
        data["tenants"] = [{"name": "bench", "api_key": _API_KEY}]
    elif which != "none":
        data["tenants"] = [{"name": "bench", "api_key": _API_KEY, "tokens_per_minute": _HUGE,
                            "requests_per_minute": _HUGE}]
    if which == "redis":
        data["redis_url"] = url
        data["budget"] = {"redis_timeout_s": 5.0}  # valgrind is slow: never the local share
    guard = AdmissionMiddleware(trivial_app, GuardConfig.from_dict(data),
                                registry=CollectorRegistry(), clock=clock)
    await _drive(guard, 300, 16)
    owner = guard.controller
    store = owner.budget
    if which == "redis":
        while store.backend != "redis":
            await asyncio.sleep(0.05)
        store.redis.pool._clock = clock
        await _drive(guard, 300, 16)
    background = owner.background
    if background.poller is not None:
        await background.poller.stop()
    for task in background.tasks:
        task.cancel()
    await asyncio.sleep(0.01)
    assert owner.load_state.snapshot(clock()).fresh_replicas(), "replica state is stale"
    _, ok, _ = await _drive(guard, num, 16)
    assert ok == num, f"{ok} of {num} answered 200"
    assert owner.load_state.snapshot(clock()).fresh_replicas(), "state went stale"
    if which == "redis":
        print(f"pool-taken {store.redis.pool.num_taken} local {store.num_local_reserves}",
              file=sys.stderr)
    background.tasks = []
    await guard.aclose()
asyncio.run(main())
'''

VARIANTS = ("none", "tenant", "memory", "redis")


def _count(root: str, num: int, which: str, url: str, out_dir: str) -> int:
    return callgrind_instructions(root, _RUN, [str(num), which, url],
                                  f"{out_dir}/cg.{num}.{which}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", nargs="+")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from chaos.bench.budget import _RedisServer

    server = _RedisServer.start() if "redis" in variants else None
    try:
        for root in args.checkouts:
            with tempfile.TemporaryDirectory() as out_dir:
                per = {}
                for which in variants:
                    url = server.url if server is not None else ""
                    per[which] = (_count(root, 2200, which, url, out_dir)
                                  - _count(root, 200, which, url, out_dir)) / 2000
            print(f"{root}: " + "  ".join(f"{w} {n:,.0f}" for w, n in per.items())
                  + " instructions per request", flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
