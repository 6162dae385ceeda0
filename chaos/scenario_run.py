"""Run one chaos scenario: the same seeded users against a fresh topology per policy, the
scenario's faults injected on the run clock, and a verdict per policy.

Per policy (``OUT/POLICY/``): ``users.jsonl`` (one ``UserRecord`` per line), ``faults.json``
(the fault events as they happened), ``verdict.json`` (``chaos.verdict``). The scenario's
combined ``verdict.json``, ``report.md`` and ``timeline.png`` are written by ``chaos.chaos_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from chaos.clients import ClientConfig
from chaos.cost_inputs import fates_from_users
from chaos.envoy_entry import entry_stats
from chaos.envoy_front import front_stats
from chaos.faults import KILL_KINDS, Fault, FaultEvent, inject, scaled
from chaos.goodput import Window
from chaos.hot_prefix import hot_replica_probe
from chaos.replica import REPLICA_SERVERS, write_guard_config
from chaos.run_cost import priced_windows
from chaos.scenarios import ScenarioSpec
from chaos.schedule import LengthDist, ScheduleConfig, build_schedule
from chaos.topology import FLEET_NICENESS, Topology, TopologySpec
from chaos.users import UserRunConfig, UserRunResult, assign_clients, run_users
from chaos.verdict import Budget, FaultWindow, build_verdict
from chaos.workloads import Workload
from guard.observe.cost_config import CostConfig
from policies.cost import RequestClass

__all__ = ["RunSettings", "PolicyRun", "run_policy", "client_configs", "schedule_for",
           "NOMINAL_REPLICA_CAPACITY_GPU_RPS", "fault_window", "budget_for"]

# One sim H100 replica of llama-7b serves ~24 req/s of this traffic within SLO in GPU time
# (12.0 req/s measured at time scale 2 by `kvguard bench overload`); quick runs use it as C.
NOMINAL_REPLICA_CAPACITY_GPU_RPS = 24.0
TENANT = "chaos-tenant-0"
BUDGETED_TENANT = "chaos-budgeted"  # one user in four in the budget scenarios


@dataclass(frozen=True)
class RunSettings:
    time_scale: float = 2.0
    seed: int = 0
    model: str = "llama-7b"
    gpu: str = "h100-80g"
    prompt_tokens: str = "512:2048"
    output_tokens: str = "16:64"
    ttft_s: float = 1.0          # GPU seconds
    itl_s: float = 0.08          # GPU seconds
    patience_s: float = 6.0      # GPU seconds a user waits in all
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 256
    num_blocks: int | None = None  # KV blocks per replica; None: what the GPU holds
    replica_http: str = "h11"  # the replicas' `kvguard engine --http`
    workload: Workload | None = None  # how prompts share tokens (chaos.workloads)

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.ttft_s <= 0 or self.itl_s <= 0 or self.patience_s <= 0:
            raise ValueError("time_scale, ttft_s, itl_s and patience_s must be > 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.replica_http not in REPLICA_SERVERS:
            raise ValueError(f"replica_http must be one of {REPLICA_SERVERS}, "
                             f"got {self.replica_http!r}")
        LengthDist.parse(self.prompt_tokens), LengthDist.parse(self.output_tokens)

    @property
    def request_class(self) -> RequestClass:
        k = self.time_scale
        return RequestClass("interactive", self.ttft_s * k, self.itl_s * k)

    def engine_args(self) -> tuple[str, ...]:
        return ("--model", self.model, "--backend", "sim", "--gpu", self.gpu,
                "--time-scale", repr(self.time_scale), "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                *(() if self.num_blocks is None else ("--num-blocks", str(self.num_blocks))),
                "--http", self.replica_http)

    def overload_args(self, duration_s: float) -> argparse.Namespace:
        """The ``chaos.overload.Scenario`` arguments for measuring capacity the bench's way:
        the bench's own flag defaults, with this run's replica, traffic and SLO."""
        from chaos.overload import configure_scenario

        parser = argparse.ArgumentParser()
        configure_scenario(parser, "")
        args = parser.parse_args([])
        for key, value in dict(
                model=self.model, gpu=self.gpu, time_scale=self.time_scale, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens, num_blocks=self.num_blocks,
                prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
                ttft=self.ttft_s, itl=self.itl_s, duration=duration_s, warmup=3.0,
                client_timeout=self.patience_s, seed=self.seed,
                replica_http=self.replica_http).items():
            setattr(args, key, value)
        args.sweep = "0.8:1.5:0.1"
        if self.workload is not None:  # capacity under the run's own workload
            args.workload = self.workload.name
            for name, value in dataclasses.asdict(self.workload).items():
                if name != "name":
                    setattr(args, name, value)
        return args


def client_configs(settings: RunSettings) -> dict[str, ClientConfig]:
    """Each kind's knobs at this time scale (the SDK's own backoff constants are its own)."""
    k = settings.time_scale
    patience_s = settings.patience_s * k
    return {
        "sdk": ClientConfig("sdk", patience_s),
        "tenacity": ClientConfig("tenacity", patience_s, backoff_s=0.5 * k, backoff_max_s=8 * k),
        "bad_citizen": ClientConfig("bad_citizen", patience_s),
        "timeout_retry": ClientConfig("timeout_retry", patience_s,
                                      attempt_timeout_s=1.5 * settings.ttft_s * k),
    }


def schedule_for(spec: ScenarioSpec, settings: RunSettings, fleet_rps: float) -> ScheduleConfig:
    k, step = settings.time_scale, spec.rate_step
    burst = {} if step is None else dict(
        shape="burst", burst_rate_per_s=spec.burst_load * fleet_rps,
        burst_start_s=step.at_s * k, burst_duration_s=step.duration_s * k)
    return ScheduleConfig(rate_per_s=spec.base_load * fleet_rps, duration_s=spec.duration_s * k,
                          seed=settings.seed, prompt_tokens=LengthDist.parse(settings.prompt_tokens),
                          output_tokens=LengthDist.parse(settings.output_tokens),
                          tenant_keys=_tenants(spec), workload=settings.workload, **burst)


def _tenants(spec: ScenarioSpec) -> tuple[str, ...]:
    """The API keys users are drawn from, uniformly (the budgeted tenant is one in four)."""
    return (TENANT,) if spec.budget_ratio is None else (TENANT, TENANT, TENANT, BUDGETED_TENANT)


def budget_for(spec: ScenarioSpec, sched: ScheduleConfig) -> Budget | None:
    """The budgeted tenant's requests-per-minute limit R, set so that its users over the whole
    run are ``budget_ratio`` × what a bucket of R (starting full, refilling R a minute) allows
    over the run — so the budget binds even in a run shorter than a minute."""
    if spec.budget_ratio is None:
        return None
    share = _tenants(spec).count(BUDGETED_TENANT) / len(_tenants(spec))
    offered = share * sched.expected_count()
    allowance_per_rpm = 1.0 + sched.duration_s / 60.0
    down = any(f.kind in ("redis_kill", "redis_hang") for f in spec.faults)
    rpm = max(1, round(offered / (spec.budget_ratio * allowance_per_rpm)))
    return Budget(BUDGETED_TENANT, rpm, down)


def _guard_toml(path: Path, policy: str, settings: RunSettings, budget: Budget | None,
                trace_path: Path | None = None) -> str:
    extra = ""
    if budget is not None:
        extra = "\n\n".join(
            f'[[tenants]]\nname = "{name}"\napi_key = "{name}"\nmay_choose_class = true' + (
                f"\nrequests_per_minute = {budget.requests_per_minute}"
                if name == budget.tenant else "")
            for name in (TENANT, budget.tenant))
    c = settings.request_class
    return write_guard_config(str(path), policy=policy, ttft_s=c.ttft_s, itl_s=c.itl_s,
                              trace_path=None if trace_path is None else str(trace_path),
                              extra_toml=extra)


def _topology(spec: ScenarioSpec, settings: RunSettings, toml: str,
              steps: tuple[str, ...] = ()) -> TopologySpec:
    if spec.proxies == 0 and spec.epps == 0:
        return TopologySpec(num_replicas=1,
                            replica_args=(*settings.engine_args(), "--guard", toml, *steps),
                            niceness=FLEET_NICENESS)
    return TopologySpec(num_replicas=spec.replicas,
                        replica_args=(*settings.engine_args(), *steps),
                        num_proxies=spec.proxies, proxy_args=("--config", toml),
                        redis=spec.redis, niceness=FLEET_NICENESS, num_epps=spec.epps,
                        entry_envoy=spec.entry_balancer == "envoy", split=spec.epp_split)


def fault_window(spec: ScenarioSpec, settings: RunSettings,
                 events: Sequence[FaultEvent]) -> FaultWindow:
    """The judged window (scaled), as the faults actually happened: it starts no earlier than
    the first action of every fault planned by its start (a starved event loop acts late) and
    ends at the later of its planned end and the last recovery action (a restarted child
    healthy, SIGCONT, rate down); recovery counts from there."""
    k = settings.time_scale
    lo, hi = (x * k for x in spec.fault_window_s)
    run_end = spec.duration_s * k
    due = {f.kind for f in spec.faults if f.at_s * k <= lo}
    struck = {}
    for e in events:
        if e.kind in due and e.action in ("kill", "stop", "rate up"):
            struck.setdefault(e.kind, e.t_s)
    lo = min(max([lo, *struck.values()]), run_end - 2e-3)
    done = [e.t_s for e in events if e.action in ("healthy", "cont", "rate down")]
    end = max([hi, *done])
    first = min(f.at_s for f in spec.faults) * k
    return FaultWindow(spec.warmup_s * k, lo, min(max(end, lo + 1e-3), run_end), run_end,
                       spec.replicas, spec.num_surviving, pre_end_s=min(first, lo))


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    result: UserRunResult
    events: tuple[FaultEvent, ...]
    verdict: dict


async def _drive(specs, kinds, cfgs, run_cfg, plan: Sequence[Fault], topo: Topology,
                 hot_replica=None):
    """Users and faults on one run clock (the faults start when the users' clock does)."""
    faults: list[asyncio.Task] = []
    started: list[float] = []

    def on_start(t0_s: float) -> None:
        started.append(t0_s)
        faults.append(asyncio.create_task(inject(plan, topo, t0_s, hot_replica=hot_replica)))

    users = await run_users(specs, kinds, cfgs, run_cfg, on_start=on_start)
    return users, await faults[0], started[0]


def run_cost(spec: ScenarioSpec, settings: RunSettings, users, window: FaultWindow,
             t0_s: float, out: Path, num_replicas: int, num_guards: int) -> dict:
    """The cost of the judged period after warm-up and of the fault window (users by arrival),
    at the default prices of the run's GPU kind, as GPU time."""
    w = window
    return priced_windows(
        [("after warm-up", Window(w.warmup_s, w.run_end_s)),
         ("fault window", Window(w.start_s, w.end_s))], t0_s,
        [out / f"steps-{i}.jsonl" for i in range(num_replicas)],
        fates_from_users(users, {settings.request_class.name: settings.request_class}, t0_s),
        CostConfig(gpu=settings.gpu), time_scale=settings.time_scale, model=settings.model,
        num_replicas=num_replicas, num_guards=num_guards)


def run_policy(spec: ScenarioSpec, settings: RunSettings, policy: str, capacity_rps: float,
               out: Path, log: Callable[[str], None]) -> PolicyRun:
    """One fresh topology with ``policy``, the scenario's users and faults, the verdict."""
    out.mkdir(parents=True, exist_ok=True)
    k = settings.time_scale
    sched = schedule_for(spec, settings, capacity_rps * spec.replicas)
    specs = build_schedule(sched)
    cfgs = client_configs(settings)
    kinds = assign_clients(specs, spec.clients, settings.seed)
    budget = budget_for(spec, sched)
    # One guard (inside the replica, or one proxy): its trace explains each decision and when
    # it relayed each chunk; several proxies would interleave their lines in one shared file,
    # so none is written then.
    trace = out / "guard-trace.jsonl" if spec.proxies + spec.epps <= 1 else None
    toml = _guard_toml(out / "guard.toml", policy, settings, budget, trace)
    patience_s = settings.patience_s * k
    steps = ("--step-trace", str(out / "steps-{replica}.jsonl"))
    with Topology(_topology(spec, settings, toml, steps)) as topo:
        num_replicas = len(topo.replica_urls)
        entries = tuple(topo.entry_urls)
        # the killed proxies the clients reach directly (behind an entry Envoy: none; the
        # streams it cut are judged by time)
        killed = {topo.proxy_urls[f.target].rstrip("/") for f in spec.faults
                  if f.kind == "proxy_kill" and f.target < len(topo.proxy_urls)
                  } & {e.rstrip("/") for e in entries}
        log(f"  {policy}: {len(specs)} users over {sched.duration_s:g} s into {len(entries)} "
            f"entry point(s)")
        run_cfg = UserRunConfig(entry_urls=entries, duration_s=sched.duration_s,
                                drain_timeout_s=patience_s + 1.0, seed=settings.seed,
                                model=settings.model)
        plan = [scaled(f, k) for f in spec.faults]
        hot = None
        if any(f.kind == "replica_kill_hot" for f in plan):
            hot = hot_replica_probe(lambda: topo.replica_urls, settings.seed,
                                    getattr(settings.workload, "prefix_tokens", 1),
                                    settings.model)
        result, events, t0_s = asyncio.run(_drive(specs, kinds, cfgs, run_cfg, plan, topo, hot))
        envoy_entry = None if not spec.entry_balancer == "envoy" else entry_stats(
            topo.envoy_admin_url, out / "envoy-entry-stats.txt")
        envoy_front = None if not spec.epps else front_stats(
            topo.envoy_admin_url, out / "envoy-front-stats.txt")
    if result.entries.get("failovers"):
        log(f"  {policy}: the entry balancer sent {result.entries['failovers']} refused "
            f"connect(s) on to another entry ({result.entries['connect_failures']})")
    window = fault_window(spec, settings, events)
    verdict = build_verdict(result.users, settings.request_class, window, capacity_rps,
                            slide_s=2.0 * k, generator_warnings=result.warnings(),
                            budget=budget, proxy_kills_s=[
                                e.t_s for e in events
                                if e.kind == "proxy_kill" and e.action == "kill"],
                            killed_entries=killed, replica_kills_s=[
                                e.t_s for e in events
                                if e.kind in KILL_KINDS and e.action == "kill"],
                            behind_gateway=spec.epps > 0)
    if envoy_entry is not None:
        verdict["envoy_entry"] = envoy_entry
        log(f"  {policy}: the entry Envoy: {envoy_entry}")
    if envoy_front is not None:
        verdict["envoy_front"] = envoy_front
        log(f"  {policy}: Envoy's EPP cluster: {envoy_front}")
    verdict["cost"] = run_cost(spec, settings, result.users, window, t0_s, out, num_replicas,
                               max(1, spec.proxies + spec.epps))
    verdict["generator"] = {"cpu_percent_of_one_core": result.load.cpu_percent,
                            "cpu_wait_s": result.load.cpu_wait_s,
                            "send_lag_s": result.load.lag_s(),
                            "achieved_rate_per_s": result.load.achieved_rate_per_s,
                            "scheduled_rate_per_s": result.load.scheduled_rate_per_s,
                            "gc_pause_max_s": result.load.gc_pause_max_s,
                            "loop_lag_max_s": result.load.loop_lag_max_s,
                            "entry_balancer": result.entries}
    with open(out / "users.jsonl", "w") as f:
        f.writelines(u.to_json() + "\n" for u in result.users)
    (out / "faults.json").write_text(json.dumps([e.to_dict() for e in events], indent=1))
    (out / "verdict.json").write_text(json.dumps(verdict, indent=1))
    return PolicyRun(policy, result, tuple(events), verdict)
