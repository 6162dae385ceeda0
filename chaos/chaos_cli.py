"""``kvguard chaos``: game days on loopback.

    kvguard chaos list
    kvguard chaos run NAME [--quick] [--policy P]... [--out DIR] [--json]

``run`` measures the capacity of one sim replica (a saturation probe and an open-loop sweep,
as ``kvguard bench overload`` does; ``--quick`` uses the nominal capacity instead, ``--capacity``
a given one), then serves the same seeded users once per policy — ``always_admit``, ``slo``
and any ``--policy`` — each against a fresh topology with the scenario's faults, and writes
``verdict.json``, ``report.md`` and ``timeline.png`` into the output folder. The exit code is
0 when every check passed, 1 when one failed (or a run was invalid), 2 for a usage error or a
scenario this build cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from chaos.chaos_report import checks, plot_timelines, policy_costs, render_report, render_table
from chaos.cost_report import has_cost, plot_cost
from chaos.overload import POLICIES
from chaos.overload_plan import ROUTING_POLICIES
from chaos.replica import exit_on_sigterm
from chaos.scenario_run import NOMINAL_REPLICA_CAPACITY_GPU_RPS, RunSettings, run_policy
from chaos.scenarios import (
    ScenarioSpec,
    catalogue,
    missing_dependencies,
    quick_variant,
    settings_for,
)
from chaos.verdict import THRESHOLDS

__all__ = ["configure", "run", "run_scenario", "measure_capacity_rps", "BASE_POLICIES"]

BASE_POLICIES: tuple[str, ...] = ("always_admit", "slo")


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True,
                           help="list the scenarios, or run one")
    sub.add_parser("list", help="the scenarios, what each needs, and whether it can run here")
    r = sub.add_parser("run", help="run one scenario for always_admit, slo and any --policy")
    r.add_argument("name", help="scenario name (see `kvguard chaos list`)")
    r.add_argument("--quick", action="store_true",
                   help="the short CI version, at the nominal capacity (no sweep)")
    r.add_argument("--policy", action="append", default=[], choices=(*POLICIES, *ROUTING_POLICIES),
                   help="another policy to run beside always_admit and slo (repeatable)")
    r.add_argument("--out", default=None, help="output folder (default runs/chaos-NAME-<time>)")
    r.add_argument("--json", action="store_true", help="print the verdict JSON on stdout")
    r.add_argument("--capacity", type=float, default=None,
                   help="capacity of one replica in req/s at this time scale (skips the sweep)")
    r.add_argument("--time-scale", type=float, default=2.0,
                   help="stretch every GPU step and every scenario time by this factor")
    r.add_argument("--seed", type=int, default=0, help="workload seed")


def _list() -> int:
    from guard.cli import SUBCOMMANDS

    for name, spec in catalogue().items():
        missing = missing_dependencies(spec, SUBCOMMANDS)
        front = (f"{spec.proxies} proxy(ies)" + (" behind Envoy" if spec.entry_balancer == "envoy"
                                                  else "") if spec.proxies else
                 f"Envoy{' (split)' if spec.epp_split else ''} + {spec.epps} kvguard epp"
                 if spec.epps else "in-process guard")
        topo = (f"{spec.replicas} replica(s), " + front
                + (", redis" if spec.redis else ""))
        state = "ready" if not missing else "UNAVAILABLE: " + "; ".join(missing)
        print(f"{name:13s} {spec.summary}\n{'':13s} [{topo}] {state}")
    return 0


def measure_capacity_rps(settings: RunSettings, quick: bool, given_rps: float | None,
                         out: Path, log) -> tuple[float, str]:
    """One replica's capacity (req/s at this time scale) and where the number came from."""
    if given_rps is not None:
        if given_rps <= 0:
            raise ValueError("--capacity must be > 0")
        return given_rps, "given (--capacity)"
    if quick:
        return NOMINAL_REPLICA_CAPACITY_GPU_RPS / settings.time_scale, "nominal (--quick)"
    from chaos.overload import Scenario, measure_capacity

    log("measuring the capacity of one replica (probe + sweep) ...")
    _, cap, _ = measure_capacity(Scenario(settings.overload_args(16.0)), out / "capacity", log)
    return cap, "measured (probe + sweep of one replica)"


def run_scenario(spec: ScenarioSpec, policies: list[str], settings: RunSettings, out: Path,
                 log, *, quick: bool, capacity: tuple[float, str]) -> dict:
    """Every policy's run of ``spec`` and the combined verdict (also written to ``out``);
    ``capacity`` is one replica's (req/s at this time scale) and its source."""
    cap, how = capacity
    log(f"capacity per replica {cap:.2f} req/s ({how}); fleet C = {cap * spec.replicas:.2f}")
    runs = {p: run_policy(spec, settings, p, cap, out / p, log) for p in policies}
    verdicts = {p: r.verdict for p, r in runs.items()}
    redis_down = any(f.kind in ("redis_kill", "redis_hang") for f in spec.faults)
    result = {
        "scenario": spec.name, "summary": spec.summary, "quick": quick,
        "command": "kvguard chaos " + " ".join(sys.argv[2:]),
        "time_scale": settings.time_scale, "seed": settings.seed,
        "capacity_per_replica_rps": cap, "capacity_source": how,
        "fleet_capacity_rps": cap * spec.replicas, "thresholds": THRESHOLDS,
        "policies": verdicts, "checks": checks(verdicts, settings.time_scale, redis_down),
    }
    result["passed"] = all(c["pass"] for group in result["checks"].values()
                           for c in ([group] if "pass" in group else group.values()))
    plot_timelines({p: (r.result.users, r.events, r.verdict) for p, r in runs.items()},
                   settings.request_class, spec.duration_s * settings.time_scale + 2.0,
                   0.5 * settings.time_scale, out / "timeline.png",
                   f"kvguard chaos {spec.name}: {spec.summary}")
    cost = policy_costs(verdicts)
    if has_cost(cost):
        plot_cost(cost["windows"], out / "cost.png")
    (out / "verdict.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(render_report(result))
    return result


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list()
    from guard.cli import SUBCOMMANDS

    specs = catalogue()
    if args.name not in specs:
        raise ValueError(f"no scenario {args.name!r}; choose from {', '.join(specs)}")
    spec = quick_variant(specs[args.name]) if args.quick else specs[args.name]
    missing = missing_dependencies(spec, SUBCOMMANDS)
    if missing:
        raise ValueError(f"scenario {spec.name} cannot run in this build: " + "; ".join(missing))
    exit_on_sigterm()
    policies = list(dict.fromkeys([*BASE_POLICIES, *args.policy]))
    settings = settings_for(spec, RunSettings(time_scale=args.time_scale, seed=args.seed))
    out = Path(args.out or f"runs/chaos-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else \
        (lambda m: print(m, flush=True))
    log(f"kvguard chaos {spec.name}{' (quick)' if args.quick else ''}: {spec.summary}; "
        f"output in {out}")
    capacity = measure_capacity_rps(settings, args.quick, args.capacity, out, log)
    result = run_scenario(spec, policies, settings, out, log, quick=args.quick,
                          capacity=capacity)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("\n" + render_table(result["policies"]))
        failed = [f"{p}.{k}" for p, group in result["checks"].items()
                  for k, c in (group.items() if "pass" not in group else [("", group)])
                  if not c["pass"]]
        print(f"\nchecks: {'all passed' if not failed else 'FAILED ' + ', '.join(failed)}")
        print(f"report: {out / 'report.md'}  plot: {out / 'timeline.png'}")
    return 0 if result["passed"] else 1
