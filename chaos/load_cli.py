"""``kvguard load``: an open-loop load test with a goodput report, or a capacity sweep.

    kvguard load --url http://127.0.0.1:8000 --rate 20 --duration 30 --warmup 5 --out runs/x
    kvguard load --url ... --duration 20 --sweep 0.5:2:0.25 --base-rate 40 --out runs/sweep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from chaos.client import require_loopback
from chaos.goodput import Window
from chaos.load import CLIENTS, LoadConfig, run_load
from chaos.plots import plot_sweep
from chaos.progress import progress
from chaos.report import write_run
from chaos.schedule import SHAPES, ClassShare, LengthDist, ScheduleConfig, build_schedule
from chaos.server_metrics import counter_deltas, scrape, server_outcomes
from chaos.summary import build_summary
from chaos.sweep import MIN_GOODPUT_RATIO, SweepPoint, capacity, capacity_label, sweep_rates
from chaos.workloads import add_workload_args, workload_from_args
from policies.cost import RequestClass

__all__ = ["configure", "run", "run_once", "parse_mix"]

SETTLE_TIMEOUT_S = 3.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of the server (loopback only)")
    p.add_argument("--rate", type=float, help="arrivals per second (not with --sweep)")
    p.add_argument("--duration", type=float, required=True, help="schedule length, seconds")
    p.add_argument("--shape", choices=SHAPES, default="poisson",
                   help="arrival process")
    p.add_argument("--burst-rate", type=float, default=0.0, help="arrivals/s inside the burst")
    p.add_argument("--burst-start", type=float, default=0.0, help="burst start, seconds")
    p.add_argument("--burst-duration", type=float, default=0.0, help="burst length, seconds")
    p.add_argument("--prompt-tokens", default="128", help="N, LO:HI or ln:MEDIAN:SIGMA:MAX")
    p.add_argument("--output-tokens", default="64", help="N, LO:HI or ln:MEDIAN:SIGMA:MAX")
    add_workload_args(p)
    p.add_argument("--class", dest="class_name", default="interactive", help="SLO class name")
    p.add_argument("--ttft", type=float, default=1.0, help="class TTFT limit, seconds")
    p.add_argument("--itl", type=float, default=0.08, help="class inter-token limit, seconds")
    p.add_argument("--mix", default=None, metavar="NAME:TTFT_S:ITL_S:WEIGHT,...",
                   help="several SLO classes and their traffic shares (overrides --class, "
                        "--ttft, --itl)")
    p.add_argument("--tenants", type=int, default=1, help="number of tenant API keys")
    p.add_argument("--api-keys", default=None, metavar="KEY,KEY,...",
                   help="explicit tenant API keys (default chaos-tenant-0..N-1)")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of arrivals left out of goodput")
    p.add_argument("--seed", type=int, default=0,
                   help="arrival-time seed")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds after the schedule to let requests finish")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="the client's connection pool size")
    p.add_argument("--client", choices=CLIENTS, default="aiohttp",
                   help="the HTTP client: aiohttp, or raw asyncio protocols (chaos.raw_client: "
                        "less CPU per request, for floods)")
    p.add_argument("--metrics-url", default=None,
                   help="Prometheus page(s) to reconcile with, comma-separated (default: "
                        "URL/kvguard/metrics and URL/metrics; 'none' to skip)")
    p.add_argument("--admin-key", default=os.environ.get("KVGUARD_ADMIN_API_KEY"),
                   help="bearer key for a guard's protected metrics pages (default "
                        "$KVGUARD_ADMIN_API_KEY)")
    p.add_argument("--step-trace", action="append", default=[], metavar="FILE",
                   help="a replica's step trace (kvguard engine --step-trace; one per replica): "
                        "adds the cost of the goodput window to the report")
    p.add_argument("--cost-config", default=None, metavar="TOML",
                   help="guard TOML whose [cost] table prices the run (default: the built-in "
                        "prices of --engine-gpu)")
    p.add_argument("--engine-gpu", default="h100-80g",
                   help="the replicas' GPU kind: its default price and roofline for the cost "
                        "(default h100-80g)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per GPU second of sim replicas (kvguard engine "
                        "--time-scale): the cost prices GPU time (default 1: real GPUs)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas provisioned for the cost (default: one per --step-trace)")
    p.add_argument("--engine-model", default="llama-7b",
                   help="model preset whose roofline weighs each step's work for the cost")
    p.add_argument("--out", default=None, help="output folder (default runs/load-<time>)")
    p.add_argument("--sweep", default=None, help="START:STOP:STEP multiples of --base-rate")
    p.add_argument("--base-rate", type=float, default=None, help="base rate for --sweep")
    p.add_argument("--quiet", action="store_true", help="no live progress")


def parse_mix(text: str) -> list[tuple[RequestClass, float]]:
    """``"interactive:1.0:0.08:3,batch:30:1:1"`` -> [(class, weight), ...]."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 4:
            raise ValueError(f"bad --mix entry {item!r}: use NAME:TTFT_S:ITL_S:WEIGHT")
        try:
            ttft_s, itl_s, weight = (float(x) for x in parts[1:])
        except ValueError:
            raise ValueError(f"bad --mix entry {item!r}: numbers expected") from None
        out.append((RequestClass(parts[0], ttft_s, itl_s), weight))
    if len({c.name for c, _ in out}) != len(out):
        raise ValueError(f"--mix {text!r} names a class twice")
    return out


def _mix(args) -> list[tuple[RequestClass, float]]:
    if args.mix:
        return parse_mix(args.mix)
    return [(RequestClass(args.class_name, args.ttft, args.itl), 1.0)]


def _schedule_config(args, rate: float) -> ScheduleConfig:
    keys = tuple(k.strip() for k in args.api_keys.split(",")) if args.api_keys else ()
    return ScheduleConfig(
        rate_per_s=rate, duration_s=args.duration, shape=args.shape, seed=args.seed,
        prompt_tokens=LengthDist.parse(args.prompt_tokens),
        output_tokens=LengthDist.parse(args.output_tokens),
        classes=tuple(ClassShare(c.name, w) for c, w in _mix(args)),
        num_tenants=args.tenants, tenant_keys=keys,
        burst_rate_per_s=args.burst_rate, burst_start_s=args.burst_start,
        burst_duration_s=args.burst_duration, workload=workload_from_args(args))


def _model_name(url: str, key: str | None) -> str | None:
    headers = {"authorization": f"Bearer {key}"} if key else None
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=5.0, trust_env=False,
                         headers=headers)
        return resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def _metrics_urls(args) -> list[str]:
    """Explicit ``--metrics-url`` (comma-separated), or the guard's page plus the server's."""
    if args.metrics_url == "none":
        return []
    if args.metrics_url:
        return [u.strip() for u in args.metrics_url.split(",") if u.strip()]
    base = args.url.rstrip("/")
    return [base + "/kvguard/metrics", base + "/metrics"]


_told_refused: set[str] = set()


def _refused(url: str, status: int) -> None:
    if url not in _told_refused:
        _told_refused.add(url)
        print(f"WARNING: {url} answered {status}: pass --admin-key (or set "
              "KVGUARD_ADMIN_API_KEY) to reconcile with the server's counters", file=sys.stderr)


def _scrape_all(urls: list[str], admin_key: str | None = None) -> dict | None:
    """All samples of every page that answered (names do not collide); None if none did."""
    pages = [p for p in (scrape(u, admin_key=admin_key, on_refused=_refused) for u in urls)
             if p is not None]
    return {k: v for page in pages for k, v in page.items()} if pages else None


def _settled_after(urls: list[str], before: dict, admin_key: str | None) -> dict | None:
    """Scrape until the server's outcome counters add up (its in-flight work done)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = _scrape_all(urls, admin_key)
        if after is None:
            return None
        out = server_outcomes(counter_deltas(before, after), after)
        if out is None or time.monotonic() > deadline or out["offered"] == sum(
                out[k] for k in ("completed", "rejected", "failed", "canceled")):
            return after
        time.sleep(0.1)


def _server_block(urls: list[str], before: dict | None, admin_key: str | None) -> dict | None:
    if not urls or before is None:
        return None
    after = _settled_after(urls, before, admin_key)
    if after is None:
        return {"urls": urls, "deltas": None, "outcomes": None}
    deltas = counter_deltas(before, after)
    return {"urls": urls, "deltas": deltas, "outcomes": server_outcomes(deltas, after)}


def run_once(args, rate: float, out_dir: Path, model: str | None) -> dict:
    """One open-loop run at ``rate``; writes the run files and returns the summary."""
    sched = _schedule_config(args, rate)
    classes = {c.name: c for c, _ in _mix(args)}
    if not 0 <= args.warmup < args.duration:
        raise ValueError(f"--warmup must be in [0, --duration), got {args.warmup}")
    window = Window(args.warmup, args.duration)
    cfg = LoadConfig(url=args.url, duration_s=args.duration, seed=args.seed, model=model,
                     timeout_s=args.timeout, drain_timeout_s=args.drain_timeout,
                     max_connections=args.max_connections, client=args.client)
    specs = build_schedule(sched)
    metrics_urls = _metrics_urls(args)
    before = _scrape_all(metrics_urls, args.admin_key)
    started: list[float] = []
    with progress(quiet=args.quiet) as on_tick:
        def tick(counts, elapsed_s: float) -> None:
            if not started:  # the run's start on this machine's monotonic clock (the traces')
                started.append(time.monotonic() - elapsed_s)
            if on_tick is not None:
                on_tick(counts, elapsed_s)
        result = asyncio.run(run_load(specs, cfg, on_tick=tick, tick_s=0.2))
    summary = build_summary(result, declared_rate_per_s=rate, shape=args.shape,
                            classes=classes, window=window,
                            server=_server_block(metrics_urls, before, args.admin_key),
                            declared_mean_rate_per_s=sched.expected_count() / args.duration)
    if args.step_trace:
        summary["cost"] = _cost_block(args, result.records, classes, window, started[0])
    write_run(out_dir, result.records, summary, classes, window)
    return summary


def _cost_block(args, records, classes, window: Window, t0_s: float) -> dict:
    """The goodput window's cost (``chaos.cost``), from the replicas' step traces."""
    from chaos.cost_cli import read_cost_config
    from chaos.cost_inputs import fates_from_records
    from chaos.run_cost import priced_windows
    from guard.observe.cost_config import CostConfig

    config = (read_cost_config(args.cost_config) if args.cost_config
              else CostConfig(gpu=args.engine_gpu))
    return priced_windows([(None, window)], t0_s, args.step_trace,
                          fates_from_records(records, classes, t0_s), config,
                          time_scale=args.time_scale, model=args.engine_model,
                          num_replicas=args.replicas)


def _print_summary(summary: dict, out_dir: Path) -> None:
    c, gp = summary["counts"], summary["goodput"]["total"]
    print(f"offered {c['offered']}  completed {c['completed']}  rejected {c['rejected']}  "
          f"failed {c['failed']}  canceled {c['canceled']}")
    print(f"goodput {gp['goodput_per_s']['strict']:.2f} req/s strict "
          f"(p99-gap {gp['goodput_per_s']['p99_gap']:.2f}, mean-TPOT "
          f"{gp['goodput_per_s']['mean_tpot']:.2f}); achieved rate "
          f"{summary['achieved_rate_per_s'] or 0:.2f} req/s")
    for w in summary["warnings"]:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"report: {out_dir / 'report.md'}")


def _point(rate: float, summary: dict, out_dir: Path) -> SweepPoint:
    t = summary["goodput"]["total"]
    return SweepPoint(rate, t["num_offered"], t["offered_per_s"], t["completed_per_s"],
                      t["goodput_per_s"]["strict"], t["goodput_ratio"]["strict"], str(out_dir))


def _run_sweep(args, out_dir: Path, model: str | None) -> int:
    if args.base_rate is None:
        raise ValueError("--sweep needs --base-rate")
    points, num_completed = [], 0
    for rate in sweep_rates(args.sweep, args.base_rate):
        sub = out_dir / f"rate_{rate:g}"
        print(f"--- rate {rate:g} req/s")
        summary = run_once(args, rate, sub, model)
        num_completed += summary["counts"]["completed"]
        points.append(_point(rate, summary, sub))
    cap = capacity(points)
    plot_sweep([p.rate_per_s for p in points], [p.offered_per_s for p in points],
               [p.completed_per_s for p in points], [p.goodput_per_s for p in points],
               out_dir / "sweep.png", cap)
    label = capacity_label(points, cap)
    doc = {"capacity_rate_per_s": cap, "capacity_is_lower_bound": label.startswith("≥"),
           "min_goodput_ratio": MIN_GOODPUT_RATIO,
           "points": [p.to_dict() for p in points]}
    (out_dir / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"capacity (goodput >= {MIN_GOODPUT_RATIO:.0%} of offered): "
          f"{label}; see {out_dir / 'sweep.png'}")
    return _exit_status(num_completed)


def run(args) -> int:
    require_loopback(args.url)
    out_dir = Path(args.out or f"runs/load-{time.strftime('%Y%m%d-%H%M%S')}")
    keys = args.api_keys.split(",") if args.api_keys else []
    model = args.model or _model_name(args.url, args.admin_key or (keys[0].strip() if keys
                                                                    else None))
    if args.sweep:
        return _run_sweep(args, out_dir, model)
    if args.rate is None:
        raise ValueError("give --rate (or --sweep with --base-rate)")
    summary = run_once(args, args.rate, out_dir, model)
    _print_summary(summary, out_dir)
    return _exit_status(summary["counts"]["completed"])


def _exit_status(num_completed: int) -> int:
    """1 when not one request completed (a dead URL, a wrong key, a server that sheds all):
    scripts that run ``kvguard load`` must not read such a run as a success."""
    if num_completed == 0:
        print("kvguard load: no request completed", file=sys.stderr)
        return 1
    return 0
