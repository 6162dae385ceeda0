"""``kvguard bench overload --fleet N``: the same bake-off behind ``kvguard proxy``.

Each row sends the bench's arrivals to one ``kvguard proxy`` in front of N sim replicas of the
scenario's engine, instead of one replica with the guard mounted in-process:

* capacity: the fleet's C is N × the one-replica C (measured by the usual probe and sweep on
  one replica, or ``--capacity``, which is per replica); loads are multiples of the fleet's C;
* the N replicas start once and serve every row (before each row every replica is idle
  again); each row gets a fresh proxy configured with its policy, so no fitted model, queue
  or pressure state carries over from one row to the next;
* there is no ``bare`` row (N replicas need something in front of them): the reference is
  ``always_admit``, the proxy that routes least-loaded and admits everything — the plain load
  balancer — and each row's ``÷ ref`` is its goodput ÷ that row's at the same load;
* the proxy gets no connection caps (``--max-connections 0 --max-connections-per-client 0``:
  the load generator is one client) and a short drain, so a row that ends with a backlog is
  cut off rather than drained into the next;
* OpenAI-SDK rows and the engine-step gap attribution are single-replica only; the TTFT
  forecast column comes from the proxy's trace;
* three rows put Envoy in front instead (``deploy/envoy/envoy.yaml``, :mod:`chaos.envoy_front`):
  ``envoy_adaptive_concurrency`` — Envoy's own adaptive concurrency filter (its gradient
  controller, as Envoy documents it) over a least-request cluster of the replicas, no kvguard
  at all —, ``envoy_circuit_breaker`` — the same cluster with Envoy's circuit breakers, retry
  budget and route retries (:mod:`chaos.envoy_breaker`; its ``max_requests`` is
  ``--envoy-max-requests``) — and ``envoy_epp_slo`` — Envoy with
  ``kvguard epp`` (``slo``) picking the replica.
* every replica appends its engine steps to one step trace for the whole bench; each row's
  cost is its goodput window's part of them (``chaos.run_cost``);
* with a ``--workload`` whose prompts share tokens, every replica restarts before each row (cold
  prefix caches: no row inherits the previous one's), and each row reports the engines'
  measured prefix-cache hit ratio and the guard's predicted one over the row.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from chaos.admission_quality import forecast_error
from chaos.cache_hits import engine_counts, guard_counts, hit_ratio
from chaos.envoy_breaker import CircuitBreaker
from chaos.envoy_front import envoy_child, epp_child
from chaos.load_cli import run_once
from chaos.overload_plan import ENVOY_ROWS
from chaos.overload_table import row_from_run
from chaos.replica import wait_idle, write_guard_config
from chaos.report import read_records
from chaos.topology import FLEET_NICENESS, Topology, TopologySpec

__all__ = ["Fleet", "PROXY_ARGS"]

PROXY_ARGS = ("--max-connections", "0", "--max-connections-per-client", "0")
_PROXY_TOML = "[proxy]\ndrain_timeout_s = 1.0"


class Fleet:
    """N sim replicas of ``scenario``'s engine, up for the whole bench (``with Fleet(...)``)."""

    def __init__(self, scenario, num_replicas: int, out: Path | None = None) -> None:
        """``out``: where each replica writes its engine step trace (``steps-<i>.jsonl``, for
        each row's cost); None: no step traces, no cost."""
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) \
                or num_replicas < 1:
            raise ValueError(f"--fleet: must be an integer >= 1, got {num_replicas!r}")
        self.scenario = scenario
        self.num_replicas = num_replicas
        self.step_traces = [] if out is None else [out / f"steps-{i}.jsonl"
                                                   for i in range(num_replicas)]
        steps = () if out is None else ("--step-trace", str(out / "steps-{replica}.jsonl"))
        self.topology = Topology(TopologySpec(num_replicas=num_replicas,
                                              replica_args=(*scenario.engine_args(), *steps),
                                              niceness=FLEET_NICENESS))

    def __enter__(self) -> Fleet:
        self.topology.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.topology.close()

    def run_policy(self, policy: str, rate: float, cap_rps: float, out: Path,
                   policy_params: dict) -> dict:
        """One row: a fresh proxy with ``policy`` in front of the fleet, one open-loop run at
        ``rate``. ``cap_rps`` is the fleet's C."""
        out.mkdir(parents=True, exist_ok=True)
        if getattr(self.scenario.args, "workload", "unique") != "unique":
            # prompts that share tokens: every row starts from cold prefix caches, or each
            # would find the previous row's prefixes cached
            self.topology.restart_replicas()
        for url in self.topology.replica_urls:
            wait_idle(url)
        engine_before = engine_counts(self.topology.replica_urls)
        c = self.scenario.request_class
        trace = out / "guard-trace.jsonl"
        guard_policy = "slo" if policy in ENVOY_ROWS else policy  # the EPP's (unused: Envoy's)
        config = write_guard_config(str(out / "guard.toml"), policy=guard_policy, ttft_s=c.ttft_s,
                                    itl_s=c.itl_s, trace_path=str(trace),
                                    policy_params=policy_params, extra_toml=_PROXY_TOML,
                                    settings=self.scenario.guard_settings(out.parent))
        breaker = self.circuit_breaker(cap_rps) if policy == "envoy_circuit_breaker" else None
        fronts = self._fronts(policy, config, out, breaker)
        try:
            for child in fronts:
                child.start(self.topology.spec.start_timeout_s)
            summary = run_once(self.scenario.load_args(fronts[-1].url, rate, out,
                                                       step_traces=self.step_traces),
                               rate, out, None)
            # the guard's predicted hits: from a kvguard proxy's metrics (Envoy rows: none)
            guard_after = None if policy in ENVOY_ROWS else guard_counts(
                fronts[0].url + "/kvguard/metrics")
        finally:
            for child in reversed(fronts):
                with contextlib.suppress(Exception):
                    child.terminate()
        row = row_from_run(summary, read_records(out / "requests.jsonl"), self.scenario, cap_rps)
        row["engine_hit_ratio"] = hit_ratio(engine_before,
                                            engine_counts(self.topology.replica_urls))
        row["guard_hit_ratio"] = hit_ratio(None, guard_after)
        row["forecast"] = forecast_error(trace, (summary["goodput"]["window_s"][0],
                                                 float("inf")))
        row["gaps"] = None
        row["cost"] = summary.get("cost")
        if breaker is not None:
            row["envoy_circuit_breaker"] = breaker.to_dict()
        return row

    def circuit_breaker(self, cap_rps: float) -> CircuitBreaker:
        """The ``envoy_circuit_breaker`` rows' thresholds: M from ``--envoy-max-requests``,
        P from C and the TTFT limit (:meth:`CircuitBreaker.at_capacity`)."""
        return CircuitBreaker.at_capacity(self.scenario.args.envoy_max_requests, cap_rps,
                                          self.scenario.request_class.ttft_s)

    def _fronts(self, policy: str, config: str, out: Path,
                breaker: CircuitBreaker | None = None) -> list:
        """What this row puts in front of the replicas, in start order (the clients' entry
        last): a kvguard proxy, Envoy alone with its adaptive concurrency filter or with
        ``breaker``, or a kvguard epp and Envoy."""
        topology = self.topology
        nice = topology.spec.niceness
        if policy == "envoy_adaptive_concurrency":
            return [envoy_child([], out, adaptive_concurrency=True, niceness=nice,
                                alone_upstreams=[url.removeprefix("http://")
                                                 for url in topology.replica_urls])]
        if policy == "envoy_circuit_breaker":
            return [envoy_child([], out, circuit_breaker=breaker, niceness=nice,
                                alone_upstreams=[url.removeprefix("http://")
                                                 for url in topology.replica_urls])]
        if policy == "envoy_epp_slo":
            epp = epp_child(topology.replica_urls, config=config, name="epp-slo", niceness=nice)
            return [epp, _EnvoyAfter(epp, out, nice)]
        return [topology.proxy_child(("--config", config, *PROXY_ARGS), f"proxy-{policy}")]


class _EnvoyAfter:
    """Envoy in front of an EPP whose port is known once the EPP has started."""

    def __init__(self, epp, directory: Path, niceness: int) -> None:
        self._epp, self._directory, self._niceness = epp, directory, niceness
        self._child = None

    def start(self, timeout_s: float):
        self._child = envoy_child([self._epp.port], self._directory,
                                  niceness=self._niceness).start(timeout_s)
        return self._child

    @property
    def url(self) -> str:
        return self._child.url

    def terminate(self) -> None:
        if self._child is not None:
            self._child.terminate()
