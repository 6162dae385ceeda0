"""``kvguard demo --scenario seed``: the fleet version of the demo.

The chaos suite's ``seed`` scenario — the reference overload scaled to this machine: 4 sim
replicas behind the kvguard proxy, users at 0.74 C (C = one replica's capacity × 4), a burst to
1.16 C, one replica SIGKILLed during the burst and restarted after it, clients retrying (the
OpenAI SDK, tenacity, timeout-and-retry, a few bad citizens) — once with ``always_admit`` and
once with ``slo``, each on a fresh fleet. One replica's capacity is its saturation throughput S
from the demo's probe (or ``--replica-capacity``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from chaos.chaos_cli import BASE_POLICIES, run_scenario
from chaos.chaos_report import render_table
from chaos.overload import Scenario, probe_saturation
from chaos.replica import ReplicaProcess
from chaos.scenario_run import RunSettings
from chaos.scenarios import catalogue, missing_dependencies

__all__ = ["run_fleet_demo"]


def _settings(args: argparse.Namespace) -> RunSettings:
    return RunSettings(time_scale=args.time_scale, seed=args.seed, model=args.model,
                       gpu=args.gpu, prompt_tokens=args.prompt_tokens,
                       output_tokens=args.output_tokens, ttft_s=args.ttft, itl_s=args.itl,
                       patience_s=args.client_timeout,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
                       replica_http=args.replica_http)


def run_fleet_demo(args: argparse.Namespace) -> int:
    from guard.cli import SUBCOMMANDS

    spec = catalogue()[args.scenario]
    missing = missing_dependencies(spec, SUBCOMMANDS)
    if missing:
        raise ValueError(f"demo --scenario {spec.name} cannot run: " + "; ".join(missing))
    settings = _settings(args)
    out = Path(args.out or f"runs/demo-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"kvguard demo --scenario {spec.name}: {spec.summary}\n  output folder: {out}",
          flush=True)
    if args.replica_capacity is not None:
        if args.replica_capacity <= 0:
            raise ValueError("--replica-capacity must be > 0")
        capacity = (args.replica_capacity, "given (--replica-capacity)")
    else:
        print("1/3 measuring one replica's saturation throughput S ...", flush=True)
        with ReplicaProcess.start(Scenario(args).engine_args()) as replica:
            sat = probe_saturation(Scenario(args), replica.base_url, out / "probe")
        capacity = (sat, "saturation throughput S of one replica (demo probe)")
    print(f"2/3 {' and '.join(BASE_POLICIES)} on a fresh fleet each ...", flush=True)
    result = run_scenario(spec, list(BASE_POLICIES), settings, out,
                          lambda m: print(m, flush=True), quick=False, capacity=capacity)
    print("3/3 done\n\n" + render_table(result["policies"]) + "\n")
    print(f"verdict: {out / 'verdict.json'}  report: {out / 'report.md'}  "
          f"timeline: {out / 'timeline.png'}")
    return 0
