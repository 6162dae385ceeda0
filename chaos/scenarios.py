"""The chaos scenarios: what runs, what breaks and when, and what each one needs.

Times in a ``ScenarioSpec`` are GPU seconds; the runner stretches them by the sim's time scale
(as ``kvguard bench overload`` does), so the queueing dynamics are those of the GPU at real
speed. Loads are multiples of the fleet capacity C (capacity per replica × replicas).

Topologies: ``replicas`` sim replicas of the 7 B reference model; with ``proxies`` = 0 the
guard runs in-process on the single replica (``kvguard engine --guard``); otherwise
``proxies`` ``kvguard proxy`` processes front all replicas and the clients spread their
attempts over the proxies round-robin (with ``entry_balancer = "envoy"``, one Envoy in front of
the proxies does: :mod:`chaos.envoy_entry`); with ``epps`` > 0 one Envoy fronts the replicas instead,
with that many ``kvguard epp`` as its endpoint pickers (``epp_split``: on the split config,
``deploy/envoy/envoy-split.yaml``). ``redis`` adds a redis-server for the
proxies' (or EPPs') budgets and shared KV reservations.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field

from chaos.faults import Fault
from chaos.workloads import SharedPrefix, Workload

__all__ = ["ScenarioSpec", "catalogue", "missing_dependencies", "quick_variant", "settings_for"]

SDK_ONLY: Mapping[str, float] = {"sdk": 1.0}
ENTRY_BALANCERS: tuple[str, ...] = ("clients", "envoy")
RETRYING: Mapping[str, float] = {"sdk": 0.4, "tenacity": 0.2, "timeout_retry": 0.3,
                                 "bad_citizen": 0.1}


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    summary: str
    replicas: int
    proxies: int
    duration_s: float                  # schedule length (GPU s)
    warmup_s: float                    # arrivals before it are left out (GPU s)
    base_load: float                   # × C
    faults: tuple[Fault, ...]
    fault_window_s: tuple[float, float]  # the judged fault period (GPU s, by arrival)
    num_surviving: int                 # replicas serving during the fault window
    burst_load: float | None = None    # × C inside the rate_step fault, if there is one
    clients: Mapping[str, float] = field(default_factory=lambda: dict(SDK_ONLY))
    redis: bool = False
    budget_ratio: float | None = None  # a budgeted tenant (1 user in 4) asks this × its allowance
    epps: int = 0                      # > 0: Envoy + this many kvguard epp in place of proxies
    workload: Workload | None = None   # how prompts share tokens (chaos.workloads); None: unique
    prompt_tokens: str | None = None   # the prompt (question) lengths; None: the run's settings
    num_blocks: int | None = None      # KV blocks per replica; None: the run's settings
    # who spreads the clients over the proxies: their own round-robin ("clients") or one Envoy
    entry_balancer: str = "clients"
    # with epps: Envoy on deploy/envoy/envoy-split.yaml (a decision filter and an observer
    # filter, the response off the EPP's path) instead of envoy.yaml
    epp_split: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.fault_window_s
        if not 0 <= self.warmup_s <= lo < hi <= self.duration_s:
            raise ValueError(f"scenario {self.name}: need warmup <= fault window <= duration")
        if self.replicas < 1 or self.proxies < 0 or not 0 <= self.num_surviving <= self.replicas:
            raise ValueError(f"scenario {self.name}: bad replica / proxy counts")
        steps = [f for f in self.faults if f.kind == "rate_step"]
        if len(steps) > 1 or (steps and self.burst_load is None):
            raise ValueError(f"scenario {self.name}: one rate_step at most, with burst_load")
        if self.epps < 0 or (self.epps and self.proxies):
            raise ValueError(f"scenario {self.name}: Envoy + EPPs replace the proxies")
        if self.epp_split and not self.epps:
            raise ValueError(f"scenario {self.name}: epp_split is Envoy's config for EPPs")
        if self.entry_balancer not in ENTRY_BALANCERS or (
                self.entry_balancer == "envoy" and not self.proxies):
            raise ValueError(f"scenario {self.name}: entry_balancer must be one of "
                             f"{ENTRY_BALANCERS} (envoy: in front of proxies)")
        if self.proxies == 0 and self.epps == 0 and self.replicas != 1:
            raise ValueError(f"scenario {self.name}: an in-process guard fronts one replica")

    @property
    def rate_step(self) -> Fault | None:
        return next((f for f in self.faults if f.kind == "rate_step"), None)

    def needs(self) -> tuple[str, ...]:
        out = []
        if self.proxies:
            out.append("proxy")
        if self.epps:
            out.append("epp")
        if self.epps or self.entry_balancer == "envoy":
            out.append("envoy")
        if self.redis:
            out.append("budgets")
        return tuple(out)


def _step(at_s: float, duration_s: float) -> Fault:
    return Fault("rate_step", at_s, duration_s)


def catalogue() -> dict[str, ScenarioSpec]:
    """Every scenario by name (full length; ``quick_variant`` shortens one)."""
    specs = [
        ScenarioSpec("burst", "a burst to 1.6 C for 6 s on 0.74 C, SDK clients", 1, 0, 24.0,
                     4.0, 0.74, (_step(8.0, 6.0),), (8.0, 14.0), 1, burst_load=1.6),
        ScenarioSpec("retry-storm", "a burst to 2 C with timeout-retry, bad-citizen, tenacity "
                     "and SDK clients", 1, 0, 24.0, 4.0, 0.74, (_step(8.0, 6.0),),
                     (8.0, 14.0), 1, burst_load=2.0, clients=dict(RETRYING)),
        ScenarioSpec("recovery", "a 10 s burst to 3 C on 0.74 C, SDK clients retrying: how "
                     "fast does goodput come back once the burst ends?", 1, 0, 30.0, 4.0, 0.74,
                     (_step(8.0, 10.0),), (8.0, 18.0), 1, burst_load=3.0),
        ScenarioSpec("metastable", "0.9 C with retrying clients and a 2 s trigger at 2 C: "
                     "does goodput come back after the trigger?", 1, 0, 28.0, 4.0, 0.9,
                     (_step(8.0, 2.0),), (8.0, 10.0), 1, burst_load=2.0,
                     clients=dict(RETRYING)),
        ScenarioSpec("replica-kill", "SIGKILL one of 2 replicas behind the proxy at 0.74 C, "
                     "restart it 6 s later", 2, 1, 24.0, 4.0, 0.74,
                     (Fault("replica_kill", 8.0, 6.0, 0),), (8.0, 14.0), 1),
        ScenarioSpec("proxy-kill", "SIGKILL one of 2 proxies behind the clients' load "
                     "balancer (round-robin; a refused connect goes on to the other), "
                     "restart it 6 s later", 2, 2, 24.0, 4.0, 0.74,
                     (Fault("proxy_kill", 8.0, 6.0, 0),), (8.0, 14.0), 2),
        ScenarioSpec("proxy-kill-envoy", "proxy-kill with one Envoy as the clients' load "
                     "balancer (health checks and outlier detection take the killed proxy "
                     "out, connect failures retried on the other)", 2, 2, 24.0, 4.0, 0.74,
                     (Fault("proxy_kill", 8.0, 6.0, 0),), (8.0, 14.0), 2,
                     entry_balancer="envoy"),
        ScenarioSpec("redis-kill", "SIGKILL the budgets' Redis for 6 s under 2 proxies; one "
                     "user in 4 is a tenant asking 1.25 × what its requests-per-minute budget allows", 2, 2,
                     24.0, 4.0, 0.74, (Fault("redis_kill", 8.0, 6.0),), (8.0, 14.0), 2,
                     redis=True, budget_ratio=1.25),
        ScenarioSpec("redis-hang", "SIGSTOP the budgets' Redis for 6 s under 2 proxies; one "
                     "user in 4 is a tenant asking 1.25 × its budget", 2, 2, 24.0, 4.0, 0.74,
                     (Fault("redis_hang", 8.0, 6.0),), (8.0, 14.0), 2, redis=True,
                     budget_ratio=1.25),
        ScenarioSpec("cache-loss", "shared-prefix load (32 prefixes of 2,000 tokens, Zipf) at "
                     "0.74 C on 4 replicas whose pools hold about half of them; SIGKILL the "
                     "replica holding the hottest prefix, restart it (cold) 4 s later", 4, 1,
                     28.0, 4.0, 0.74, (Fault("replica_kill_hot", 10.0, 4.0),), (10.0, 16.0), 3,
                     workload=SharedPrefix(32, 2000, 1.0), prompt_tokens="50:150",
                     num_blocks=2000),
        ScenarioSpec("warm-up", "shared-prefix load at 0.74 C on 4 replicas: the whole fleet "
                     "restarts at once (a deploy) and comes back cold under the load", 4, 1,
                     28.0, 4.0, 0.74, tuple(Fault("replica_kill", 10.0, 1.0, i)
                                            for i in range(4)), (10.0, 18.0), 4,
                     workload=SharedPrefix(32, 2000, 1.0), prompt_tokens="50:150",
                     num_blocks=2000),
        ScenarioSpec("seed", "the reference overload: 0.74 C, a burst to 1.16 C, one of 4 "
                     "replicas lost during it, clients retrying", 4, 1, 32.0, 4.0, 0.74,
                     (_step(10.0, 10.0), Fault("replica_kill", 12.0, 10.0, 1)),
                     (12.0, 20.0), 3, burst_load=1.16, clients=dict(RETRYING)),
        ScenarioSpec("seed-envoy", "the seed scenario through Envoy with kvguard epp as its "
                     "endpoint picker (in place of kvguard proxy)", 4, 0, 32.0, 4.0, 0.74,
                     (_step(10.0, 10.0), Fault("replica_kill", 12.0, 10.0, 1)),
                     (12.0, 20.0), 3, burst_load=1.16, clients=dict(RETRYING), epps=1),
        ScenarioSpec("epp-kill", "SIGKILL one of 2 kvguard epp behind one Envoy (sharing "
                     "Redis) at 0.74 C, restart it 6 s later", 2, 0, 24.0, 4.0, 0.74,
                     (Fault("epp_kill", 8.0, 6.0, 0),), (8.0, 14.0), 2, redis=True, epps=2),
        ScenarioSpec("epp-kill-split", "epp-kill with Envoy's split config (a decision filter, "
                     "the response reported by an observer filter to the EPP that decided): "
                     "the killed EPP's streams should run on", 2, 0, 24.0, 4.0, 0.74,
                     (Fault("epp_kill", 8.0, 6.0, 0),), (8.0, 14.0), 2, redis=True, epps=2,
                     epp_split=True),
    ]
    return {s.name: s for s in specs}


def settings_for(spec: ScenarioSpec, settings):
    """The run settings with the scenario's own prompt lengths, KV pool and workload."""
    changes = {}
    if spec.prompt_tokens is not None:
        changes["prompt_tokens"] = spec.prompt_tokens
    if spec.num_blocks is not None:
        changes["num_blocks"] = spec.num_blocks
    if spec.workload is not None:
        changes["workload"] = spec.workload
    return dataclasses.replace(settings, **changes) if changes else settings


def quick_variant(spec: ScenarioSpec) -> ScenarioSpec:
    """The CI version, same shape: warm-up 2 s, the first fault at 4 s, each fault and the
    judged window at most 3 s long, 4 s after the last fault ends."""
    shift = min(f.at_s for f in spec.faults) - 4.0

    def move(f: Fault) -> Fault:
        dur = None if f.duration_s is None else min(f.duration_s, 3.0)
        return Fault(f.kind, f.at_s - shift, dur, f.target)

    faults = tuple(move(f) for f in spec.faults)
    lo, hi = spec.fault_window_s
    window = (lo - shift, lo - shift + min(hi - lo, 3.0))
    end = max([window[1], *(f.end_s or f.at_s for f in faults)]) + 4.0
    return dataclasses.replace(spec, duration_s=end, warmup_s=2.0, faults=faults,
                               fault_window_s=window)


def missing_dependencies(spec: ScenarioSpec, subcommands: Mapping[str, object]) -> list[str]:
    """What this kvguard lacks to run ``spec`` (empty when it can run)."""
    missing = []
    if "proxy" in spec.needs() and "proxy" not in subcommands:
        missing.append("the standalone proxy (`kvguard proxy`, issue 9) is not in this build")
    if "epp" in spec.needs():
        if "epp" not in subcommands:
            missing.append("the endpoint picker (`kvguard epp`, issue 36) is not in this build")
        if importlib.util.find_spec("grpc") is None:
            missing.append("the gateway extra (grpcio, xds-protos) is not installed")
    if "envoy" in spec.needs():
        try:
            from chaos.envoy_front import envoy_binary
            envoy_binary()
        except ValueError as exc:
            missing.append(str(exc))
    if "budgets" in spec.needs():
        from guard.config import TenantConfig
        names = {f.name for f in dataclasses.fields(TenantConfig)}
        if "requests_per_minute" not in names:
            missing.append("per-tenant requests_per_minute budgets in the guard config "
                           "(issue 10) are not in this build")
        if importlib.util.find_spec("guard.budget.redis_store") is None:
            missing.append("the Redis budget store (guard.budget.redis_store, issue 10) is "
                           "not in this build")
    return missing
