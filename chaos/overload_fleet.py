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
* with a ``--workload`` whose prompts share tokens, every replica restarts before each row (cold
  prefix caches: no row inherits the previous one's), and each row reports the engines'
  measured prefix-cache hit ratio and the guard's predicted one over the row.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from chaos.admission_quality import forecast_error
from chaos.cache_hits import engine_counts, guard_counts, hit_ratio
from chaos.load_cli import run_once
from chaos.overload_table import row_from_run
from chaos.replica import wait_idle, write_guard_config
from chaos.report import read_records
from chaos.topology import FLEET_NICENESS, Topology, TopologySpec

__all__ = ["Fleet", "PROXY_ARGS"]

PROXY_ARGS = ("--max-connections", "0", "--max-connections-per-client", "0")
_PROXY_TOML = "[proxy]\ndrain_timeout_s = 1.0"


class Fleet:
    """N sim replicas of ``scenario``'s engine, up for the whole bench (``with Fleet(...)``)."""

    def __init__(self, scenario, num_replicas: int) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) \
                or num_replicas < 1:
            raise ValueError(f"--fleet: must be an integer >= 1, got {num_replicas!r}")
        self.scenario = scenario
        self.num_replicas = num_replicas
        self.topology = Topology(TopologySpec(num_replicas=num_replicas,
                                              replica_args=tuple(scenario.engine_args()),
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
        config = write_guard_config(str(out / "guard.toml"), policy=policy, ttft_s=c.ttft_s,
                                    itl_s=c.itl_s, trace_path=str(trace),
                                    policy_params=policy_params, extra_toml=_PROXY_TOML)
        proxy = self.topology.proxy_child(("--config", config, *PROXY_ARGS), f"proxy-{policy}")
        proxy.start(self.topology.spec.start_timeout_s)
        try:
            summary = run_once(self.scenario.load_args(proxy.url, rate, out), rate, out, None)
            guard_after = guard_counts(proxy.url + "/kvguard/metrics")
        finally:
            with contextlib.suppress(Exception):
                proxy.terminate()
        row = row_from_run(summary, read_records(out / "requests.jsonl"), self.scenario, cap_rps)
        row["engine_hit_ratio"] = hit_ratio(engine_before,
                                            engine_counts(self.topology.replica_urls))
        row["guard_hit_ratio"] = hit_ratio(None, guard_after)
        row["forecast"] = forecast_error(trace, (summary["goodput"]["window_s"][0],
                                                 float("inf")))
        row["gaps"] = None
        return row
