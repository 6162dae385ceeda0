"""``kvguard bench sheds``: how fast the guard says no when it is flooded.

One small, slow sim replica with the guard (``slo``) mounted in-process is offered far more than
it can serve (default 2,000 req/s of short prompts for 3 s, open loop). Almost everything must
be shed, and a shed is only useful if it is fast: the guard decides on the forecast at once
(the fast no) instead of queueing requests until their deadline. Reported side by side: how
many requests were answered, the shed latency at the client (p50/p99; target p99 ≤ 10 ms on
this machine), the admitted ones' goodput, and the guard's own event-loop lag (the largest
lateness of a 10 ms timer while the flood ran; target ≤ 50 ms), read from its metrics.

A shed is a 429/503 the guard decided (it carries ``x-kvguard-reason``). A 503 without one is
the server refusing a connection over its per-client cap (``serving.limited_protocol``): it
happens when the generator holds more than 1,024 connections, i.e. when answers come back
slowly, and is counted apart (``refused``).

What bounds the run on a small machine is printed beside it: the CPU per offered request of
the replica process (server, guard and sim engine together) and of the load generator (this
process), and the generator's CPU wait, send lag and achieved rate. The generator and the
replica share the machine's cores; a run where the generator fell behind its schedule or
waited for a CPU says so, and its latencies include that wait. To keep the sender's share
small it sends with ``chaos.raw_client`` (``--client raw``, ~0.2 ms of CPU per request against
~0.5–0.9 ms for aiohttp, ``--client aiohttp``) and with its own cyclic collector off for the
flood (:func:`flood`).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from pathlib import Path

import httpx
import psutil

from chaos.load_cli import configure as configure_load
from chaos.load_cli import run_once
from chaos.replica import ReplicaProcess, exit_on_sigterm, write_guard_config
from chaos.report import read_records
from chaos.stats import percentile

__all__ = ["configure", "run", "flood", "shed_row", "loop_lag_max_s", "engine_args", "load_args"]

_LOOP_LAG = re.compile(r"^kvguard_event_loop_lag_max_seconds\s+([0-9.eE+-]+)$", re.M)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=2000.0, help="offered req/s")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals")
    p.add_argument("--time-scale", type=float, default=20.0,
                   help="sim slow-down: the replica serves a few req/s")
    p.add_argument("--max-num-seqs", type=int, default=4,
                   help="the sim replica's sequence slots")
    p.add_argument("--ttft", type=float, default=1.0, help="class TTFT limit, wall seconds")
    p.add_argument("--itl", type=float, default=1.0, help="class ITL limit, wall seconds")
    p.add_argument("--seed", type=int, default=0,
                   help="arrival-time seed")
    p.add_argument("--http", choices=("h11", "kvguard"), default="h11",
                   help="the replica's HTTP server (kvguard engine --http): uvicorn's h11 "
                        "(the engine's default) or kvguard's own")
    p.add_argument("--client", choices=("raw", "aiohttp"), default="raw",
                   help="the load generator's HTTP client: raw asyncio protocols "
                        "(chaos.raw_client, the default: the sender's CPU shares the replica's "
                        "cores) or aiohttp (the older runs in docs/benchmarks.md)")
    p.add_argument("--out", default=None, help="output folder (default runs/sheds-<time>)")


def engine_args(args: argparse.Namespace, guard_config: str | None) -> list[str]:
    """The small, slow sim replica on the chosen HTTP server, with the guard mounted (None:
    bare, for a proxy in front)."""
    guard = [] if guard_config is None else ["--guard", guard_config]
    return ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
            "--time-scale", repr(args.time_scale), "--max-num-seqs", str(args.max_num_seqs),
            *guard, "--http", args.http]


def loop_lag_max_s(metrics_text: str) -> float | None:
    match = _LOOP_LAG.search(metrics_text)
    return float(match.group(1)) if match else None


def _is_shed(r) -> bool:
    return r.status in (429, 503) and r.reason is not None


def shed_row(records, rate: float, duration_s: float) -> dict:
    """Counts and shed latencies (client-side, seconds) of one flood run: a shed is the guard's
    429/503 (with ``x-kvguard-reason``); another 503 is a refused connection."""
    sheds = [r.e2e_s for r in records if _is_shed(r) and r.e2e_s is not None]
    answered = [r for r in records if r.status is not None]
    return {
        "offered": len(records), "offered_rps": rate, "answered": len(answered),
        "answered_rps": len(answered) / duration_s if duration_s > 0 else 0.0,
        "admitted": sum(r.status == 200 for r in records), "shed": len(sheds),
        "refused": sum(r.status == 503 and r.reason is None for r in records),
        "no_answer": len(records) - len(answered),
        "shed_p50_s": percentile(sheds, 50), "shed_p99_s": percentile(sheds, 99),
        "shed_max_s": max(sheds, default=None),
    }


def load_args(url: str, args: argparse.Namespace, out: Path) -> argparse.Namespace:
    """The flood's ``kvguard load`` arguments against ``url`` (a replica or a proxy)."""
    p = argparse.ArgumentParser()
    configure_load(p)
    return p.parse_args([
        "--url", url, "--rate", repr(args.rate), "--duration", repr(args.duration),
        "--prompt-tokens", "32:64", "--output-tokens", "8", "--ttft", repr(args.ttft),
        "--itl", repr(args.itl), "--seed", str(args.seed), "--timeout", "30",
        "--drain-timeout", "30", "--max-connections", "4096", "--client", args.client,
        "--out", str(out), "--quiet"])


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    if not (args.rate > 0 and args.duration > 0 and args.time_scale > 0):
        raise ValueError("--rate, --duration and --time-scale must be > 0")
    out = Path(args.out or f"runs/sheds-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    config = write_guard_config(str(out / "guard.toml"), policy="slo", ttft_s=args.ttft,
                                itl_s=args.itl)
    with ReplicaProcess.start(engine_args(args, config)) as replica:
        server = psutil.Process(replica.proc.pid)
        server_cpu0 = _cpu_s(server)
        summary = flood(load_args(replica.base_url, args, out), args.rate, out)
        server_cpu_s = _cpu_s(server) - server_cpu0
        metrics = httpx.get(replica.base_url + "/kvguard/metrics", timeout=10.0,
                            trust_env=False).text
    row = shed_row(read_records(out / "requests.jsonl"), args.rate, args.duration)
    row["loop_lag_max_s"] = loop_lag_max_s(metrics)
    row["http"] = args.http
    row["client"] = args.client
    row.update(_cost_row(summary, server_cpu_s, row["offered"]))
    row["warnings"] = summary["warnings"]
    (out / "sheds.json").write_text(json.dumps(
        {"command": " ".join(["kvguard", "bench", "sheds", *sys.argv[3:]]), **row}, indent=1))
    print(render(row))
    print(render_cost(row))
    for w in row["warnings"]:
        print(f"WARNING: {w}", file=sys.stderr)
    return 0


def flood(load_args: argparse.Namespace, rate: float, out: Path) -> dict:
    """The load run, with the generator's cyclic garbage collector off while it lasts (the run
    is bounded: ``--duration`` of arrivals, then at most 30 s of drain). Its collections
    pause the sender's one event loop, and every response that arrives meanwhile is read late
    and counted slow: with ``few_collections`` (``chaos.load``) the generator still paused
    20–51 ms at a time in one 3 s flood (young collections of 24 and 41 ms; a full one of 51
    ms, which ``few_collections`` now holds off too). Only reference cycles wait for the
    collection after the run; the replica's own collector is untouched (it is what is
    measured)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return run_once(load_args, rate, out, None)
    finally:
        if was_enabled:
            gc.enable()


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _cost_row(summary: dict, server_cpu_s: float, offered: int) -> dict:
    """What the flood cost each side in CPU, and how the generator kept up. The replica's CPU
    is over the load run (the report writing after it is the generator's own)."""
    gen = summary["load_generator"]
    lag = summary["send_lag_s"]
    per = 1e6 / offered if offered else 0.0
    return {"server_cpu_us_per_request": server_cpu_s * per,
            "loadgen_cpu_us_per_request": gen["cpu_s"] * per,
            "loadgen_cpu_wait_s": gen["cpu_wait_s"], "loadgen_wall_s": gen["wall_s"],
            "loadgen_achieved_rps": summary["achieved_rate_per_s"],
            "loadgen_lag_p99_s": lag.get("p99")}


def render_cost(row: dict) -> str:
    wait = row["loadgen_cpu_wait_s"]
    return (f"replica CPU {row['server_cpu_us_per_request']:.0f} µs/request; load generator "
            f"CPU {row['loadgen_cpu_us_per_request']:.0f} µs/request, achieved "
            f"{row['loadgen_achieved_rps'] or 0:.0f} req/s, send lag p99 "
            f"{1000 * (row['loadgen_lag_p99_s'] or 0):.0f} ms, waited for a CPU "
            f"{'—' if wait is None else f'{wait:.1f}'} s of {row['loadgen_wall_s']:.1f} s")


def render(row: dict) -> str:
    def ms(x):
        return "—" if x is None else f"{1000 * x:.1f}"

    return ("| offered (req/s) | answered (req/s) | admitted | shed | refused | no answer | "
            "shed p50 (ms) | shed p99 (ms) | shed max (ms) | guard loop lag max (ms) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n"
            f"| {row['offered']} ({row['offered_rps']:.0f}) | {row['answered']} "
            f"({row['answered_rps']:.0f}) | {row['admitted']} | {row['shed']} | "
            f"{row['refused']} | {row['no_answer']} | {ms(row['shed_p50_s'])} | {ms(row['shed_p99_s'])} | "
            f"{ms(row['shed_max_s'])} | {ms(row['loop_lag_max_s'])} |")
