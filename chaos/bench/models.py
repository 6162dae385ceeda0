"""``kvguard bench models``: a two-model fleet behind one ``kvguard proxy``.

Two models, each on ``--replicas-per-model`` sim replicas of the overload scenario's engine
(``kvguard bench overload``'s flags: preset, lengths, SLO, time scale) with a capacity of its
own: model A's replicas model ``--gpu-a``, model B's ``--gpu-b`` (and ``--num-blocks-a`` /
``--num-blocks-b`` when given), each engine serving its model's name. The proxy is told
nothing about models: it reads each replica's ``/v1/models``.

* C per model is its replicas × one replica's C, measured as ``kvguard bench overload``
  measures it (saturation probe, then the sweep: the highest rate keeping 90 % of offered
  requests good) on one replica of that model, or given per replica (``--capacity-a`` /
  ``--capacity-b``);
* each row (a policy at a load) starts a fresh proxy in front of all the replicas and sends
  one mixed open-loop stream: each model's arrivals at load × its own C (its own seeded
  sizes), merged in time, every request naming its model;
* per model the row reports goodput (requests within the class TTFT and ITL, arrivals after
  the warm-up) ÷ C, the load generator's own warnings (off its schedule, waiting for a CPU:
  the run then measures the machine, not the fleet) and the misrouted requests: those the proxy's trace shows sent to a
  replica that does not serve their model, plus any that a replica refused as an unknown
  model (404). The target is 0.

Every process is a child on loopback; the load generator is the bench's own (chaos.load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

from chaos.child import ChildProcess
from chaos.client import request_body
from chaos.goodput import Window, goodput
from chaos.load import LoadConfig, run_load
from chaos.overload import Scenario, configure_scenario, measure_capacity, policy_params
from chaos.overload_fleet import PROXY_ARGS
from chaos.ports import free_port
from chaos.replica import wait_idle, write_guard_config
from chaos.schedule import ClassShare, ScheduleConfig, build_schedule, prompt_token_ids
from chaos.topology import FLEET_NICENESS, Topology, TopologySpec, http_health

__all__ = ["configure", "run"]

MODELS = ("model-a", "model-b")
_PROXY_TOML = "[proxy]\ndrain_timeout_s = 1.0"


def configure(p: argparse.ArgumentParser) -> None:
    configure_scenario(p, "runs/models-<time>")
    p.add_argument("--replicas-per-model", type=int, default=2,
                   help="sim replicas serving each model (default: 2)")
    p.add_argument("--gpu-a", default="a100-80g",
                   help="GPU profile of model A's replicas (default: a100-80g)")
    p.add_argument("--gpu-b", default="h100-80g",
                   help="GPU profile of model B's replicas (default: h100-80g)")
    p.add_argument("--num-blocks-a", type=int, default=None,
                   help="KV blocks of each model A replica (default: --num-blocks)")
    p.add_argument("--num-blocks-b", type=int, default=None,
                   help="KV blocks of each model B replica (default: --num-blocks)")
    p.add_argument("--capacity-a", type=float, default=None,
                   help="one model A replica's C in req/s at this time scale (default: "
                        "measured by the probe and --sweep)")
    p.add_argument("--capacity-b", type=float, default=None,
                   help="one model B replica's C in req/s (default: measured)")
    p.add_argument("--sweep", default="0.8:1.6:0.1",
                   help="capacity sweep, multiples of the saturation throughput S "
                        "(default: 0.8:1.6:0.1)")
    p.add_argument("--loads", default="1.5",
                   help="multiples of each model's C, one row per load and policy "
                        "(default: 1.5)")
    p.add_argument("--policies", default="always_admit,slo",
                   help="policies, one proxy per row (default: always_admit,slo)")


def run(args: argparse.Namespace) -> int:
    if args.replicas_per_model < 1:
        raise ValueError(f"--replicas-per-model: must be >= 1, got {args.replicas_per_model}")
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not loads or any(x <= 0 for x in loads) or not policies:
        raise ValueError("--loads: positive numbers and --policies: at least one name")
    out = Path(args.out or time.strftime("runs/models-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    scenarios = {MODELS[0]: _scenario(args, args.gpu_a, args.num_blocks_a),
                 MODELS[1]: _scenario(args, args.gpu_b, args.num_blocks_b)}
    given = {MODELS[0]: args.capacity_a, MODELS[1]: args.capacity_b}
    per_replica = {}
    for model, scenario in scenarios.items():
        if given[model] is not None:
            per_replica[model] = given[model]
        else:
            _, per_replica[model], _ = measure_capacity(scenario, out / f"capacity-{model}",
                                                        _log)
        _log(f"{model}: C = {per_replica[model]:.2f} req/s per replica "
             f"({scenario.args.gpu}, blocks {scenario.args.num_blocks or 'all'})")
    caps = {m: c * args.replicas_per_model for m, c in per_replica.items()}
    rows = []
    with contextlib.ExitStack() as stack:
        fleets = {m: stack.enter_context(Topology(TopologySpec(
            num_replicas=args.replicas_per_model, niceness=FLEET_NICENESS,
            replica_args=(*s.engine_args(), "--served-model-name", m))))
            for m, s in scenarios.items()}
        for load in loads:
            for policy in policies:
                row_dir = out / f"{policy}-{load:g}"
                rows += _row(policy, load, scenarios, caps, fleets, row_dir)
                for line in _table(rows[-len(MODELS):]).splitlines()[2:]:
                    _log(line)
    table = _table(rows)
    (out / "results.json").write_text(json.dumps(
        {"capacity_per_replica": per_replica, "rows": rows}, indent=2) + "\n")
    (out / "report.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out / 'report.md'} and {out / 'results.json'}")
    return 0


def _scenario(args: argparse.Namespace, gpu: str, num_blocks: int | None) -> Scenario:
    own = copy.copy(args)
    own.gpu = gpu
    if num_blocks is not None:
        own.num_blocks = num_blocks
    return Scenario(own)


def _row(policy: str, load: float, scenarios: dict, caps: dict, fleets: dict,
         out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    urls = [u for f in fleets.values() for u in f.replica_urls]
    for url in urls:
        wait_idle(url)
    first = next(iter(scenarios.values()))
    c = first.request_class
    trace = out / "guard-trace.jsonl"
    config = write_guard_config(str(out / "guard.toml"), policy=policy, ttft_s=c.ttft_s,
                                itl_s=c.itl_s, trace_path=str(trace),
                                policy_params=policy_params(policy, first, sum(caps.values())),
                                extra_toml=_PROXY_TOML)
    specs, bodies, model_of = _mixed_stream(scenarios, caps, load)
    proxy = _proxy(urls, config, f"proxy-{policy}").start(90.0)
    try:
        cfg = LoadConfig(url=proxy.url, duration_s=first.duration_s, seed=first.args.seed,
                         timeout_s=first.timeout_s, drain_timeout_s=first.timeout_s)
        result = asyncio.run(run_load(specs, cfg, bodies=bodies))
    finally:
        proxy.terminate()
    with open(out / "requests.jsonl", "w") as f:  # each client record, with its model
        f.writelines(json.dumps({**json.loads(r.to_json()), "model": model_of[r.index]}) + "\n"
                     for r in result.records)
    # replica ids as the proxy names them: r0.. in --upstream order, model A's first
    ids = {}
    for model, fleet in fleets.items():
        for _ in fleet.replica_urls:
            ids[f"r{len(ids)}"] = model
    misrouted = _misrouted(trace, ids)
    for warning in result.warnings():  # the run may not measure the fleet: say so
        _log(f"WARNING ({policy} at {load:g} x C): {warning}")
    window = Window(first.warmup_s, first.duration_s)
    classes = {c.name: c}
    rows = []
    for model in scenarios:
        records = [r for r in result.records if model_of[r.index] == model]
        report = goodput(records, classes, window).to_dict()["total"]
        refused = sum(1 for r in records if r.status == 404)
        rows.append({
            "policy": policy, "load": load, "model": model, "gpu": scenarios[model].args.gpu,
            "num_replicas": len(fleets[model].replica_urls), "capacity_rps": caps[model],
            "offered_per_s": report["offered_per_s"],
            "goodput_per_s": report["goodput_per_s"]["strict"],
            "goodput_over_c": report["goodput_per_s"]["strict"] / caps[model],
            "misrouted": misrouted.get(model, 0) + refused, "run_dir": str(out),
            "load_generator_warnings": result.warnings()})
    return rows


def _mixed_stream(scenarios: dict, caps: dict, load: float):
    """Each model's seeded arrivals at ``load`` × its C, merged in time and renumbered: the
    specs, one body per spec (naming its model) and each new index's model."""
    tagged = []
    for n, (model, scenario) in enumerate(scenarios.items()):
        seed = scenario.args.seed * len(scenarios) + n  # the models' streams differ
        schedule = ScheduleConfig(
            rate_per_s=load * caps[model], duration_s=scenario.duration_s,
            shape=scenario.args.shape, seed=seed, prompt_tokens=scenario.prompt,
            output_tokens=scenario.output, classes=(ClassShare(scenario.request_class.name),))
        for spec in build_schedule(schedule):
            body = request_body(model, json.dumps(prompt_token_ids(seed, spec)),
                                spec.max_tokens)
            tagged.append((spec.scheduled_s, model, spec, body))
    tagged.sort(key=lambda t: t[0])
    specs, bodies, model_of = [], [], {}
    for index, (_, model, spec, body) in enumerate(tagged):
        specs.append(dataclasses.replace(spec, index=index))
        bodies.append(body)
        model_of[index] = model
    return specs, bodies, model_of


def _misrouted(trace: Path, model_of_replica: dict[str, str]) -> dict[str, int]:
    """Per model: admitted requests the proxy sent to a replica serving another model."""
    counts: dict[str, int] = {}
    if not trace.exists():
        return counts
    with open(trace) as f:
        for line in f:
            record = json.loads(line)
            replica, model = record.get("replica"), record.get("model")
            if replica is not None and model_of_replica.get(replica) != model:
                counts[model] = counts.get(model, 0) + 1
    return counts


def _proxy(urls: list[str], config: str, name: str) -> ChildProcess:
    upstreams = [a for url in urls for a in ("--upstream", url)]
    return ChildProcess(
        name, lambda port: [sys.executable, "-m", "guard.cli", "proxy", *upstreams,
                            "--config", config, *PROXY_ARGS, "--host", "127.0.0.1",
                            "--port", str(port)],
        http_health, ready_pattern=r"kvguard proxy listening on (\S+)", port=free_port(),
        niceness=FLEET_NICENESS)


def _table(rows: list[dict]) -> str:
    lines = ["| policy | load × C | model | GPU | replicas | C (req/s) | offered/s | "
             "goodput/s | goodput ÷ C | misrouted |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['load']:g} | {r['model']} | {r['gpu']} | "
                     f"{r['num_replicas']} | {r['capacity_rps']:.2f} | {r['offered_per_s']:.2f} | "
                     f"{r['goodput_per_s']:.2f} | {r['goodput_over_c']:.2f} | {r['misrouted']} |")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
