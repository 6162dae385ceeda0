"""``kvguard demo``: the main job, on embedded defaults (no Redis, no GPU, a few minutes).

A simulated H100 replica of the 7 B reference model (``kvguard engine --backend sim``) first has
its saturation throughput S measured; then the same seeded open-loop arrivals at ``--load`` × S
(default 1.4: a burst past what the replica can serve) are sent twice, to a replica without the
guard and to a replica with the guard (the SLO-aware policy) mounted in-process. The goodput
table shows what the guard changes; each run's folder holds the raw records, a report and plots.

Why 1.4: S is what a replica drowning in its own queue completes, less than it sustains just
below saturation, and the seeded arrivals come to ~0.93–0.95 × the nominal rate; at 1.2 a fast
machine serves every request of the no-guard run within the SLO and the demo shows no overload
at all (the runs that showed it are in docs/benchmarks.md §0).
``--scenario seed`` runs the fleet version instead (``chaos.fleet_demo``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from chaos.overload import Scenario, configure_scenario, fmt_num, probe_saturation, run_policy
from chaos.replica import ReplicaProcess, exit_on_sigterm

__all__ = ["configure", "run"]


DEFAULT_LOAD = 1.4  # × S (see the module docstring)


def configure(p: argparse.ArgumentParser) -> None:
    configure_scenario(p, "runs/demo-<time>")
    p.set_defaults(duration=12.0, warmup=2.0)
    p.add_argument("--load", type=float, default=None,
                   help="offered load as a multiple of the measured saturation throughput S "
                        f"(default {DEFAULT_LOAD}: past what the replica can serve; the "
                        "single-replica demo only)")
    p.add_argument("--scenario", choices=("seed",), default=None,
                   help="the fleet version: the chaos `seed` scenario (4 sim replicas behind "
                        "the proxy, a burst to 1.16 C, one replica lost, retrying clients) "
                        "for always_admit and slo; it has its own load and times (--load, "
                        "--duration and --warmup are the single-replica demo's)")
    p.add_argument("--replica-capacity", type=float, default=None,
                   help="with --scenario: one replica's capacity in req/s at this time scale "
                        "(skips the saturation probe)")


def _table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| replica | offered (req/s) | goodput (req/s) | good / offered | TTFT p50 (s) | "
             "TTFT p99 (s) | rejected | timed out | wasted tokens |", "|" + "---|" * 9]
    for name, r in rows:
        ratio = r["goodput_rps"] / r["offered_rps"] if r["offered_rps"] else 0.0
        lines.append(
            f"| {name} | {fmt_num(r['offered_rps'])} | {fmt_num(r['goodput_rps'])} | "
            f"{100 * ratio:.0f}% | {fmt_num(r['ttft_p50_s'])} | {fmt_num(r['ttft_p99_s'])} | "
            f"{100 * r['rejected_ratio']:.0f}% | {100 * r['canceled_ratio']:.0f}% | "
            f"{100 * r['wasted_ratio']:.0f}% |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.scenario is not None and args.load is not None:
        raise ValueError("--load applies to the single-replica demo only (the scenario sets "
                         "its own arrivals)")
    if args.load is not None and not args.load > 0:
        raise ValueError(f"--load must be > 0, got {args.load!r}")
    exit_on_sigterm()
    if args.scenario is not None:
        from chaos.fleet_demo import run_fleet_demo
        return run_fleet_demo(args)
    if args.load is None:
        args.load = DEFAULT_LOAD
    if args.replica_capacity is not None:
        raise ValueError("--replica-capacity applies to --scenario only")
    scenario = Scenario(args)
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    c = scenario.request_class
    print(f"kvguard demo: simulated {args.model} on {args.gpu}, every GPU step stretched "
          f"×{scenario.scale:g} to fit this CPU\n  SLO (wall time): first token within "
          f"{c.ttft_s:g} s, every inter-token gap within {c.itl_s * 1000:.0f} ms\n"
          f"  output folder: {out}", flush=True)
    print("1/3 measuring the replica's saturation throughput S ...", flush=True)
    with ReplicaProcess.start(scenario.engine_args()) as replica:
        sat = probe_saturation(scenario, replica.base_url, out / "probe")
    rate = args.load * sat
    print(f"    S = {sat:.2f} req/s; offered load = {args.load:g} × S = {rate:.2f} req/s "
          f"for {scenario.duration_s:g} s", flush=True)
    rows = []
    for step, (name, policy) in enumerate((("no guard", None), ("kvguard (slo)", "slo")), 2):
        print(f"{step}/3 open-loop run against the replica with {name} ...", flush=True)
        folder = out / ("no-guard" if policy is None else "guard-slo")
        row = run_policy(scenario, policy, rate, sat, folder)
        rows.append((name, row))
        print(f"    goodput {row['goodput_rps']:.2f} req/s of {row['offered_rps']:.2f} offered "
              f"({folder}/report.md)", flush=True)
    table = _table(rows)
    (out / "demo.md").write_text(f"# kvguard demo\n\nS = {sat:.2f} req/s, offered "
                                 f"{rate:.2f} req/s\n\n{table}\n")
    (out / "demo.json").write_text(json.dumps(
        {"saturation_rps": sat, "offered_rps": rate, "rows": dict(rows)}, indent=1))
    print("\n" + table + "\n")
    print(f"goodput = requests per second that completed with first token ≤ {c.ttft_s:g} s and "
          f"every gap ≤ {c.itl_s * 1000:.0f} ms.\nPlots: {out}/*/timeline.png and "
          f"{out}/*/latency_cdf.png; summary: {out}/demo.md")
    return 0
