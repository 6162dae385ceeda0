"""Instructions per admitted request, counted by valgrind's callgrind: a contention-proof
companion to ``kvguard bench guard --against`` (wall and CPU time move with other load; the
instruction count does not).

    python scripts/guard_instructions.py CHECKOUT [CHECKOUT ...] [--ablate retry,pacing,rules,forecast_error]

For each checkout (a kvguard source tree, e.g. ``git worktree add /tmp/old 30dcc2c``) the
in-process bench app is driven bare and guarded (``slo`` policy) for 200 and for 3,200 requests
under callgrind; the difference over the 3,000 extra requests is the per-request count. After a
300-request warm-up the guard's background tasks (state poller, queue pump, housekeeping) are
stopped and its clock is a counter (+10 µs per read), so the replica state stays fresh (the
policy's full path) and nothing depends on how slowly valgrind runs. ``--ablate`` switches off
features this checkout added after ``30dcc2c`` (retry budget, prefill pacing, the engine's
request rules, the forecast-error export) to compare like for like. About a minute per checkout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from callgrind_count import callgrind_instructions

_RUN = r'''
import asyncio, itertools, os, sys
ablate = set(filter(None, os.environ.get("KVGUARD_ABLATE", "").split(",")))
if "retry" in ablate:
    import policies.retry_budget as rb
    rb.RetryBudget.record = lambda self, tenant, is_retry, now_s: None
    rb.RetryBudget.view = lambda self, now_s: rb.NO_RETRY_OVER_BUDGET
if "pacing" in ablate:
    import policies.predictor as pr, policies.slo as slo
    pr.pending_prefill_tokens = lambda r, step_time, now_s: r.load.num_queued_prefill_tokens
    slo.prefill_fits_gaps = lambda *a, **k: True
if "forecast_error" in ablate:
    import guard.observe.forecast_error as fe
    fe.ForecastError.observe = lambda self, predicted_s, actual_s: None
from prometheus_client import CollectorRegistry
from chaos.bench.guard import _drive, trivial_app
from guard.config import GuardConfig
from guard.middleware import AdmissionMiddleware
num, which = int(sys.argv[1]), sys.argv[2]
ticks = itertools.count()
clock = lambda: 1000.0 + next(ticks) * 1e-5
async def main():
    guard = AdmissionMiddleware(trivial_app, GuardConfig(policy="slo"),
                                registry=CollectorRegistry(), clock=clock)
    await _drive(guard, 300, [])
    await _drive(trivial_app, 300, [])
    owner = getattr(guard, "controller", guard)
    background = owner.background
    if background.poller is not None:
        await background.poller.stop()
    for task in background.tasks:
        task.cancel()
    await asyncio.sleep(0.01)
    if "rules" in ablate:
        from guard.request.rules import ReplicaRules
        owner.rules = ReplicaRules(owner.rules.max_model_len, owner.rules.block_size)
    assert owner.load_state.snapshot(clock()).fresh_replicas(), "replica state is stale"
    await _drive(guard if which == "guarded" else trivial_app, num, [])
    assert owner.load_state.snapshot(clock()).fresh_replicas(), "state went stale"
    background.tasks = []
    await guard.aclose()
asyncio.run(main())
'''


def _count(root: str, num: int, which: str, ablate: str, out_dir: str) -> int:
    return callgrind_instructions(root, _RUN, [str(num), which], f"{out_dir}/cg.{num}.{which}",
                                  {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                                   "KVGUARD_ABLATE": ablate})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", nargs="+")
    parser.add_argument("--ablate", default="", help="comma list of retry,pacing,rules,"
                        "forecast_error (features added after 30dcc2c) to switch off")
    args = parser.parse_args()
    unknown = set(filter(None, args.ablate.split(","))) - {"retry", "pacing", "rules",
                                                          "forecast_error"}
    if unknown:
        raise SystemExit(f"--ablate: unknown {sorted(unknown)}")
    for root in args.checkouts:
        with tempfile.TemporaryDirectory() as out_dir:
            per = {which: (_count(root, 3200, which, args.ablate, out_dir)
                           - _count(root, 200, which, args.ablate, out_dir)) / 3000
                   for which in ("guarded", "bare")}
        print(f"{root}: guarded {per['guarded']:,.0f}  bare {per['bare']:,.0f}  "
              f"added {per['guarded'] - per['bare']:,.0f} instructions per request"
              + (f"  (ablated: {args.ablate})" if args.ablate else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
