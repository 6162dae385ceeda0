"""``kvguard bench sheds``: how fast the guard says no when it is flooded.

One small, slow sim replica with the guard (``slo``) mounted in-process is offered far more than
it can serve (default 2,000 req/s of short prompts for 3 s, open loop). Almost everything must
be shed, and a shed is only useful if it is fast: the guard decides on the forecast at once
(the fast no) instead of queueing requests until their deadline. Reported side by side: how
many requests were answered, the shed latency at the client (p50/p99; target p99 ≤ 10 ms on
this machine), the admitted ones' goodput, and the guard's own event-loop lag (the largest
lateness of a 10 ms timer while the flood ran; target ≤ 50 ms), read from its metrics.

The load generator reports its own lag and CPU wait: on an oversubscribed machine the numbers
include that wait and the run says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import httpx

from chaos.load_cli import configure as configure_load
from chaos.load_cli import run_once
from chaos.replica import ReplicaProcess, exit_on_sigterm, write_guard_config
from chaos.report import read_records
from chaos.stats import percentile

__all__ = ["configure", "run", "shed_row", "loop_lag_max_s"]

_LOOP_LAG = re.compile(r"^kvguard_event_loop_lag_max_seconds\s+([0-9.eE+-]+)$", re.M)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=2000.0, help="offered req/s")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals")
    p.add_argument("--time-scale", type=float, default=20.0,
                   help="sim slow-down: the replica serves a few req/s")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--ttft", type=float, default=1.0, help="class TTFT limit, wall seconds")
    p.add_argument("--itl", type=float, default=1.0, help="class ITL limit, wall seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default runs/sheds-<time>)")


def loop_lag_max_s(metrics_text: str) -> float | None:
    match = _LOOP_LAG.search(metrics_text)
    return float(match.group(1)) if match else None


def shed_row(records, rate: float, duration_s: float) -> dict:
    """Counts and shed latencies (client-side, seconds) of one flood run."""
    sheds = [r.e2e_s for r in records if r.status in (429, 503) and r.e2e_s is not None]
    answered = [r for r in records if r.status is not None]
    return {
        "offered": len(records), "offered_rps": rate, "answered": len(answered),
        "answered_rps": len(answered) / duration_s if duration_s > 0 else 0.0,
        "admitted": sum(r.status == 200 for r in records), "shed": len(sheds),
        "no_answer": len(records) - len(answered),
        "shed_p50_s": percentile(sheds, 50), "shed_p99_s": percentile(sheds, 99),
        "shed_max_s": max(sheds, default=None),
    }


def _load_args(url: str, args: argparse.Namespace, out: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_load(p)
    return p.parse_args([
        "--url", url, "--rate", repr(args.rate), "--duration", repr(args.duration),
        "--prompt-tokens", "32:64", "--output-tokens", "8", "--ttft", repr(args.ttft),
        "--itl", repr(args.itl), "--seed", str(args.seed), "--timeout", "30",
        "--drain-timeout", "30", "--max-connections", "4096", "--out", str(out), "--quiet"])


def run(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    if not (args.rate > 0 and args.duration > 0 and args.time_scale > 0):
        raise ValueError("--rate, --duration and --time-scale must be > 0")
    out = Path(args.out or f"runs/sheds-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    config = write_guard_config(str(out / "guard.toml"), policy="slo", ttft_s=args.ttft,
                                itl_s=args.itl)
    engine_args = ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
                   "--time-scale", repr(args.time_scale), "--max-num-seqs",
                   str(args.max_num_seqs), "--guard", config]
    with ReplicaProcess.start(engine_args) as replica:
        summary = run_once(_load_args(replica.base_url, args, out), args.rate, out, None)
        metrics = httpx.get(replica.base_url + "/kvguard/metrics", timeout=10.0,
                            trust_env=False).text
    row = shed_row(read_records(out / "requests.jsonl"), args.rate, args.duration)
    row["loop_lag_max_s"] = loop_lag_max_s(metrics)
    row["warnings"] = summary["warnings"]
    (out / "sheds.json").write_text(json.dumps(
        {"command": " ".join(["kvguard", "bench", "sheds", *sys.argv[3:]]), **row}, indent=1))
    print(render(row))
    for w in row["warnings"]:
        print(f"WARNING: {w}", file=sys.stderr)
    return 0


def render(row: dict) -> str:
    def ms(x):
        return "—" if x is None else f"{1000 * x:.1f}"

    return ("| offered (req/s) | answered (req/s) | admitted | shed | no answer | "
            "shed p50 (ms) | shed p99 (ms) | shed max (ms) | guard loop lag max (ms) |\n"
            "|---|---|---|---|---|---|---|---|---|\n"
            f"| {row['offered']} ({row['offered_rps']:.0f}) | {row['answered']} "
            f"({row['answered_rps']:.0f}) | {row['admitted']} | {row['shed']} | "
            f"{row['no_answer']} | {ms(row['shed_p50_s'])} | {ms(row['shed_p99_s'])} | "
            f"{ms(row['shed_max_s'])} | {ms(row['loop_lag_max_s'])} |")
