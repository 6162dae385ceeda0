"""``kvguard bench scale --proxy-state-cpu``: the CPU a real proxy spends keeping a busy fleet's
state, per streamed event.

``kvguard bench scale`` alone times the ingestion of a delta in-process (parse, apply,
``LoadState.update_from_kvguard_state``). This measures the whole proxy instead: for each
``--replicas`` N and ``--running`` R it starts ``kvguard fleet --state-only`` with N replicas,
each running R sequences of its own (``--state-held-running``; KV blocks for all of them at
their longest, so none waits for one), and one ``kvguard proxy`` in front at its defaults (state
source ``auto``, so every replica's state is streamed; the refresh interval 1 ÷
``--refresh-hz``), no requests. Once every replica is routable and ``--proxy-state-settle-s``
more have passed, it reads the proxy's CPU time (utime + stime, ``/proc/PID/stat``) over
``--proxy-state-window-s`` and the stream events it received over the same time (the sum of
``stream_events`` in its ``/kvguard/state``, read just outside the CPU window). Reported per
cell: proxy cores, events per second, proxy CPU µs per event, the fleet process's cores and
the proxy's state age (p50 and max) at the end.

The fleet process builds every replica's document and delta on the same machine: where it
cannot keep up (256 × 256 on two shared cores), fewer than N × ``--refresh-hz`` events a
second arrive, so the proxy's cores are read with its events per second, and µs per event
is the figure that carries to the full rate. ``--proxy-state-time-scale`` K slows the
replicas' steps K times (fewer decode steps and iteration samples per event, and less work
for the fleet process). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import httpx

from chaos.bench.scale_e2e import proxy_child, wait_routable
from chaos.bench.state_cpu import cpu_s, state_only_fleet

__all__ = ["add_arguments", "refuse_without_proxy_state", "run_proxy_state", "render"]

_MAX_MODEL_LEN = 4096  # chaos.state_fleet.StateFleetConfig's
_BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("proxy state CPU (--proxy-state-cpu; uses --replicas, "
                                  "--running, --refresh-hz and --json)")
    g.add_argument("--proxy-state-cpu", action="store_true",
                   help="measure a real idle proxy's CPU for the state of a state-only fleet "
                        "whose replicas each run --running sequences, instead")
    g.add_argument("--proxy-state-window-s", type=float, default=5.0,
                   help="CPU measured over this many seconds (default 5)")
    g.add_argument("--proxy-state-settle-s", type=float, default=3.0,
                   help="wait after every replica is routable (default 3)")
    g.add_argument("--proxy-state-time-scale", type=float, default=1.0,
                   help="the replicas' time scale (default 1)")


def refuse_without_proxy_state(args: argparse.Namespace) -> None:
    """ValueError naming the first ``--proxy-state-*`` flag given without
    ``--proxy-state-cpu`` (it would do nothing)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for key, default in vars(parser.parse_args([])).items():
        if key != "proxy_state_cpu" and getattr(args, key, default) != default:
            raise ValueError(f"--{key.replace('_', '-')} applies only with --proxy-state-cpu")


def _stream_events(url: str) -> tuple[int, list[dict]]:
    replicas = httpx.get(url + "/kvguard/state", timeout=30, trust_env=False).json()["replicas"]
    return sum(r.get("stream_events", 0) for r in replicas), replicas


def measure_cell(num_replicas: int, num_running: int, args: argparse.Namespace) -> dict:
    """One fleet of ``num_replicas`` × ``num_running`` and one idle proxy: its row."""
    num_blocks = max(1, num_running) * -(-_MAX_MODEL_LEN // _BLOCK_SIZE)
    fleet_args = ["--state-held-running", str(num_running), "--state-kv-blocks",
                  str(num_blocks), "--state-time-scale", str(args.proxy_state_time_scale)]
    with tempfile.TemporaryDirectory() as directory, \
            state_only_fleet(num_replicas, fleet_args) as (fleet, urls):
        config = os.path.join(directory, "proxy.toml")
        with open(config, "w") as fh:
            fh.write(f"refresh_interval_s = {1.0 / args.refresh_hz!r}\n")
        proxy = proxy_child(urls, config)
        proxy.start(300)
        try:
            wait_routable(proxy.url, num_replicas)
            time.sleep(args.proxy_state_settle_s)
            events_0, _ = _stream_events(proxy.url)
            events_start_s = time.monotonic()
            proxy_0, fleet_0, start_s = cpu_s(proxy.pid), cpu_s(fleet.pid), time.monotonic()
            time.sleep(args.proxy_state_window_s)
            proxy_1, fleet_1, end_s = cpu_s(proxy.pid), cpu_s(fleet.pid), time.monotonic()
            events_1, replicas = _stream_events(proxy.url)
            events_end_s = time.monotonic()
        finally:
            proxy.terminate()
    elapsed_s = end_s - start_s
    events_per_s = (events_1 - events_0) / (events_end_s - events_start_s)
    proxy_cores = (proxy_1 - proxy_0) / elapsed_s
    ages = sorted(r["state_age_s"] for r in replicas if r["state_age_s"] is not None)
    return {"replicas": num_replicas, "running": num_running,
            "proxy_cores": round(proxy_cores, 3),
            "events_per_s": round(events_per_s, 1),
            "events_per_s_offered": round(num_replicas * args.refresh_hz, 1),
            "cpu_us_per_event": round(proxy_cores / events_per_s * 1e6, 1)
            if events_per_s > 0 else None,
            "fleet_cores": round((fleet_1 - fleet_0) / elapsed_s, 3),
            "streamed": sum("stream_events" in r for r in replicas),
            "routable": sum(r["routable"] for r in replicas),
            "state_age_p50_s": ages[len(ages) // 2] if ages else None,
            "state_age_max_s": ages[-1] if ages else None}


def run_proxy_state(args: argparse.Namespace, replica_counts: list[int],
                    running_counts: list[int]) -> dict:
    if not args.proxy_state_window_s > 0 or args.proxy_state_settle_s < 0 \
            or not args.proxy_state_time_scale > 0:
        raise ValueError("--proxy-state-window-s and --proxy-state-time-scale must be > 0, "
                         "--proxy-state-settle-s >= 0")
    if max(running_counts) > 256:
        raise ValueError("--running: at most 256 (a replica's max_num_seqs) with "
                         "--proxy-state-cpu")
    rows = [measure_cell(n, r, args) for r in running_counts for n in replica_counts]
    return {"refresh_hz": args.refresh_hz, "time_scale": args.proxy_state_time_scale,
            "window_s": args.proxy_state_window_s, "rows": rows}


def render(report: dict) -> str:
    lines = [f"{'replicas':>8} {'running':>7} {'proxy_cores':>11} {'events/s':>9} "
             f"{'offered/s':>9} {'cpu_us/event':>12} {'fleet_cores':>11} {'age_p50_s':>9} "
             f"{'age_max_s':>9}"]
    for row in report["rows"]:
        per_event = row["cpu_us_per_event"]
        lines.append(
            f"{row['replicas']:>8} {row['running']:>7} {row['proxy_cores']:>11.3f} "
            f"{row['events_per_s']:>9.1f} {row['events_per_s_offered']:>9.1f} "
            f"{'-' if per_event is None else f'{per_event:.1f}':>12} "
            f"{row['fleet_cores']:>11.3f} {row['state_age_p50_s']!s:>9} "
            f"{row['state_age_max_s']!s:>9}")
    return "\n".join(lines)
