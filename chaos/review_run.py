"""One cell of a review: a fresh fleet, one scenario, one seed; its useful-service numbers.

The fleet is ``replicas`` sim engines (each writing its step trace) behind one ``kvguard
proxy`` with the fleet's guard config; open-loop arrivals go to the proxy; the scenario's
replica loss is a SIGKILL (``chaos.faults``). Numbers are over the requests that arrived in
the judged window, in GPU time (wall ÷ the time scale):

- ``goodput_ratio``: good requests per second ÷ C;
- ``ttft_p90_s``: TTFT p90 of the completed requests;
- ``good_tokens_per_s``: output tokens of good requests per second;
- ``cost_per_good_request_usd`` (None when none was good) and ``wasted_share``: the window's
  cost (``chaos.cost``) at the fleet's prices for GPU time.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from chaos.cost_inputs import fates_from_records
from chaos.faults import Fault, inject
from chaos.goodput import Window, meets_slo
from chaos.load import LoadConfig, run_load
from chaos.review_fleet import FleetSpec
from chaos.review_scenarios import ReviewScenario, traffic
from chaos.run_cost import priced_windows
from chaos.stats import percentile
from chaos.topology import FLEET_NICENESS, Topology, TopologySpec
from policies.cost import RequestClass

__all__ = ["run_cell", "guard_toml"]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ValueError(f"guard: cannot write {value!r} into the proxy's TOML")


def guard_toml(path: Path, guard: dict, cls: RequestClass) -> Path:
    """The proxy's config: the fleet's guard table with the review's one class and SLO."""
    scalars = {k: v for k, v in guard.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in guard.items() if isinstance(v, dict) and k != "classes"}
    scalars.setdefault("policy", "slo")
    scalars.update(default_class="interactive", anonymous_may_choose_class=True)
    lines = [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for name, table in tables.items():
        lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    lines += ["", "[classes.interactive]", f"ttft_s = {cls.ttft_s!r}", f"itl_s = {cls.itl_s!r}"]
    path.write_text("\n".join(lines) + "\n")
    return path


async def _drive(specs, bodies, url: str, scenario: ReviewScenario, topo: Topology, seed: int):
    started: list[float] = []

    def on_tick(_counts, elapsed_s: float) -> None:
        if not started:
            started.append(time.monotonic() - elapsed_s)

    cfg = LoadConfig(url=url, duration_s=scenario.duration_s, seed=seed, timeout_s=60.0,
                     drain_timeout_s=10.0, client="raw")
    plan = [] if scenario.kill_at_s is None else [Fault("replica_kill", scenario.kill_at_s,
                                                        None, 1)]
    faults = asyncio.ensure_future(inject(plan, topo, time.monotonic())) if plan else None
    result = await run_load(specs, cfg, on_tick=on_tick, tick_s=0.2, bodies=bodies)
    if faults is not None:
        await faults
    return result, started[0]


def run_cell(fleet: FleetSpec, scenario: ReviewScenario, seed: int, capacity_rps: float,
             k: float, cls: RequestClass, out: Path) -> dict:
    """Run one wall-clock ``scenario`` on a fresh ``fleet``; the numbers and the cost."""
    out.mkdir(parents=True, exist_ok=True)
    specs, bodies = traffic(scenario, capacity_rps, seed, fleet.engine.model)
    toml = guard_toml(out / "guard.toml", fleet.guard, cls)
    steps_arg = str(out / "steps-{replica}.jsonl")
    spec = TopologySpec(num_replicas=fleet.replicas,
                        replica_args=(*fleet.engine.args(k), "--step-trace", steps_arg),
                        num_proxies=1, proxy_args=("--config", str(toml)),
                        niceness=FLEET_NICENESS)
    with Topology(spec) as topo:
        result, t0_s = asyncio.run(_drive(specs, bodies, topo.proxy_urls[0], scenario, topo, seed))
    records = list(result.records)
    with open(out / "requests.jsonl", "w") as f:
        f.writelines(r.to_json() + "\n" for r in records)
    window = Window(*scenario.window_s)
    judged = [r for r in records if window.contains(r.scheduled_s)]
    good = [r for r in judged if meets_slo(r, cls)]
    ttft = [r.ttft_s for r in judged if r.successful and r.ttft_s is not None]
    fates = fates_from_records(records, {cls.name: cls}, t0_s)
    block = priced_windows([(None, window)], t0_s,
                           [out / f"steps-{i}.jsonl" for i in range(fleet.replicas)], fates,
                           fleet.cost, time_scale=k, model=fleet.engine.model)
    if not block["windows"]:
        raise RuntimeError(f"{out}: {block['unavailable']}")
    cost = block["windows"][0]
    p90 = percentile(ttft, 90.0)
    cell = {
        "goodput_ratio": len(good) / window.duration_s / capacity_rps,
        "ttft_p90_s": None if p90 is None else p90 / k,
        "good_tokens_per_s": sum(r.num_tokens_received for r in good) * k / window.duration_s,
        "cost_per_good_request_usd": cost["cost_per_good_request_usd"],
        "wasted_share": cost["wasted_share"],
        "num_offered": len(judged), "num_good": len(good),
        "cost": cost,
    }
    (out / "cell.json").write_text(json.dumps(cell, indent=1) + "\n")
    return cell
