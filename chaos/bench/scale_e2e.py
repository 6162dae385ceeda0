"""``kvguard bench scale --e2e-rate R``: R req/s end to end through one proxy and N state-only
replicas, next to a smaller fleet at the same load relative to its capacity, in one run.

For each count in ``--e2e-replicas`` (the first is the reference, default 4 then 256) it starts
``kvguard fleet --state-only`` with that many replicas at ``--time-scale`` K (every engine step
K times the roofline's: a GPU K times slower), one ``kvguard proxy`` (``slo``) in front of all
of them, and drives it open loop (Poisson) with ``kvguard load``'s generator in this process.

What is scaled by K, so that the run models the unscaled fleet at ``--e2e-rate`` on a machine
that cannot offer that rate: the wall rate offered (R ÷ K for the largest fleet), the replicas'
step times, the class SLO the proxy enforces and the client judges (TTFT and inter-token limits
× K), the guard's other durations of engine time (:func:`guard_config`), the run's duration
and warm-up, and the client's patience. What is not: the proxy's own
work per request and per relayed chunk (so the proxy does 1 ÷ K of the unscaled work per wall
second, and its state refresh, ``--e2e-refresh-s`` GPU seconds, is K times rarer in wall time:
the state-keeping cost at 10 Hz of real time is the in-process ``state_cpu_share``), the
number of requests in flight (Little's law: rate ÷ K × lifetime × K), the shed latency,
which is wall time at the lower wall rate — it says how fast a no is at R ÷ K req/s, not at R
(``--shed-flood`` measures it in wall time) — and the proxy's connection constants: an upstream
connection idle for 4 s wall is closed (``KEEPALIVE_S``), so at K ≥ 40, where a replica gets a
request every few wall seconds, most requests open a new one (a connect costs wall
milliseconds, nothing in GPU time, but on a starved machine a connect past its 5 s timeout
counts as a replica failure). A replica's state stream sends at most every 5 s wall, so at
K = 60 the refresh is 0.083 GPU s rather than 0.1.

C per replica is the sim's saturation throughput on this traffic from its roofline
(:func:`chaos.review_capacity.replica_capacity_gpu_rps`, GPU seconds), the same for every
fleet. Each smaller fleet is offered R × N ÷ N_max req/s (the same offered ÷ C), for at least
``--e2e-min-requests`` arrivals (its run is longer when its rate is low). Per fleet: requests
offered and answered (200, 429, 503; anything else or no answer is counted apart), shed latency
p50/p99 (wall), goodput (strict, GPU req/s: wall × K) ÷ (N × C) and good ÷ offered in the
window after warm-up, TTFT and inter-token gap p50/p99 (GPU seconds: wall ÷ K), the proxy's and
the fleet process's cores over the load, the generator's CPU and whether it flagged itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from chaos.bench.sheds import flood, shed_row
from chaos.bench.state_cpu import cpu_s, state_only_fleet
from chaos.child import ChildProcess
from chaos.load_cli import configure as configure_load
from chaos.replica import write_guard_config
from chaos.report import read_records
from chaos.review_capacity import replica_capacity_gpu_rps
from chaos.review_fleet import EngineFlags
from chaos.schedule import LengthDist
from chaos.stats import percentile
from chaos.topology import http_health
from guard.config import GuardConfig
from policies.slo import SloPolicy

__all__ = ["add_arguments", "plan", "run_e2e", "fleet_row", "cell", "render", "refuse_without_rate",
           "proxy_child", "wait_routable", "guard_config", "client_connections",
           "max_in_flight"]

_BATCHED_TOKENS, _NUM_SEQS = 2048, 256  # chaos.state_fleet.StateFleetConfig's defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("end to end (--e2e-rate)")
    g.add_argument("--e2e-rate", type=float, default=None, metavar="REQ_PER_S",
                   help="run end to end instead: this many req/s (GPU time) through the "
                        "largest --e2e-replicas fleet, the others at the same offered / C")
    g.add_argument("--e2e-replicas", default="4,256",
                   help="fleets, in the order run; the first is the reference (default 4,256)")
    g.add_argument("--time-scale", type=float, default=40.0,
                   help="wall seconds per GPU second of the state-only replicas (default 40)")
    g.add_argument("--e2e-duration", type=float, default=4.0,
                   help="GPU seconds of arrivals per fleet (× time scale in wall seconds)")
    g.add_argument("--e2e-warmup", type=float, default=2.0,
                   help="GPU seconds of arrivals left out of goodput and latencies")
    g.add_argument("--e2e-min-requests", type=int, default=250,
                   help="a fleet whose rate gives fewer arrivals runs longer (default 250)")
    g.add_argument("--e2e-prompt-tokens", default="4000", help="prompt tokens (N or LO:HI)")
    g.add_argument("--e2e-output-tokens", default="32", help="output tokens (N or LO:HI)")
    g.add_argument("--e2e-ttft", type=float, default=1.0, help="class TTFT limit, GPU seconds")
    g.add_argument("--e2e-itl", type=float, default=0.08, help="class gap limit, GPU seconds")
    g.add_argument("--e2e-model", default="llama-7b", help="state-only replicas' model")
    g.add_argument("--e2e-gpu", default="h100-80g", help="state-only replicas' GPU")
    g.add_argument("--e2e-refresh-s", type=float, default=0.1,
                   help="the proxy's state refresh interval, GPU seconds (× time scale: its "
                        "refresh_interval_s; its max_staleness_s is 20 × that) (default 0.1)")
    g.add_argument("--e2e-client", choices=("raw", "aiohttp"), default="raw",
                   help="the load generator's client (default raw: least CPU per request)")
    g.add_argument("--e2e-seed", type=int, default=0, help="arrival seed")
    g.add_argument("--e2e-out", default=None, help="output folder (default runs/scale-e2e-<time>)")


def refuse_without_rate(args: argparse.Namespace) -> None:
    """ValueError naming the first end-to-end flag given without ``--e2e-rate`` (it would do
    nothing)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for key, default in vars(parser.parse_args([])).items():
        if getattr(args, key, default) != default:
            raise ValueError(f"--{key.replace('_', '-')} applies only with --e2e-rate")


def plan(args: argparse.Namespace) -> dict:
    """What each fleet is offered, in GPU and wall req/s, and for how long; ValueError on bad
    flags (nothing started)."""
    try:
        counts = [int(v) for v in args.e2e_replicas.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--e2e-replicas: comma-separated integers, got "
                         f"{args.e2e_replicas!r}") from None
    k = args.time_scale
    if not counts or min(counts) < 1:
        raise ValueError(f"--e2e-replicas: integers >= 1, got {args.e2e_replicas!r}")
    if not (args.e2e_rate > 0 and k > 0 and args.e2e_duration > 0 and args.e2e_ttft > 0
            and args.e2e_itl > 0 and args.e2e_refresh_s > 0):
        raise ValueError("--e2e-rate, --time-scale, --e2e-duration, --e2e-ttft, --e2e-itl and "
                         "--e2e-refresh-s must be > 0")
    if not 0 <= args.e2e_warmup < args.e2e_duration or args.e2e_min_requests < 1:
        raise ValueError("--e2e-warmup must be in [0, --e2e-duration), --e2e-min-requests >= 1")
    prompt, output = LengthDist.parse(args.e2e_prompt_tokens), \
        LengthDist.parse(args.e2e_output_tokens)
    engine = EngineFlags(model=args.e2e_model, gpu=args.e2e_gpu,
                         max_num_batched_tokens=_BATCHED_TOKENS, max_num_seqs=_NUM_SEQS,
                         enable_prefix_caching=False)
    c_gpu_rps = replica_capacity_gpu_rps(engine, prompt, output)
    largest = max(counts)
    fleets = []
    for n in counts:
        rate_gpu = args.e2e_rate * n / largest
        wall_rate = rate_gpu / k
        duration_s = max(args.e2e_duration * k, args.e2e_min_requests / wall_rate)
        fleets.append({"replicas": n, "offered_gpu_rps": rate_gpu, "wall_rate_rps": wall_rate,
                       "duration_wall_s": duration_s,
                       "warmup_wall_s": args.e2e_warmup * k})
    return {"time_scale": k, "rate_gpu_rps": args.e2e_rate, "c_per_replica_gpu_rps": c_gpu_rps,
            "offered_over_c": args.e2e_rate / (largest * c_gpu_rps), "fleets": fleets}


def fleet_row(records: list, summary: dict, fleet: dict, k: float, c_gpu_rps: float) -> dict:
    """One fleet's report from its load records and ``kvguard load`` summary (GPU-second
    figures are wall ÷ K; shed latencies stay wall)."""
    sheds = shed_row(records, fleet["wall_rate_rps"], fleet["duration_wall_s"])
    window = summary["goodput"]["window_s"]
    done = [r for r in records if r.outcome == "completed" and window[0] <= r.scheduled_s]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    gaps = [g for r in done for g in r.itl_s]
    total = summary["goodput"]["total"]
    goodput_gpu = total["goodput_per_s"]["strict"] * k
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    gen = summary["load_generator"]

    def gpu(x):
        return None if x is None else x / k
    return {
        **fleet, "offered": sheds["offered"], "answered": sheds["answered"],
        "answered_200_429_503": sum(r.status in (200, 429, 503) for r in records),
        "admitted": sheds["admitted"], "shed": sheds["shed"], "refused": sheds["refused"],
        "no_answer": sheds["no_answer"], "statuses": dict(sorted(statuses.items())),
        "outcomes": {o: summary["counts"][o] for o in ("completed", "rejected", "failed",
                                                        "canceled")},
        "shed_p50_ms": _ms(sheds["shed_p50_s"]), "shed_p99_ms": _ms(sheds["shed_p99_s"]),
        "goodput_gpu_rps": goodput_gpu,
        "goodput_over_c": goodput_gpu / (fleet["replicas"] * c_gpu_rps),
        # the arrivals the window actually drew (Poisson): what goodput / C is read against
        "window_offered_over_c": total["offered_per_s"] * k / (fleet["replicas"] * c_gpu_rps),
        "good_over_offered": total["goodput_ratio"]["strict"],
        "ttft_p50_s": gpu(percentile(ttfts, 50)), "ttft_p99_s": gpu(percentile(ttfts, 99)),
        "gap_p50_s": gpu(percentile(gaps, 50)), "gap_p99_s": gpu(percentile(gaps, 99)),
        "loadgen_cpu_percent": gen["cpu_percent_of_one_core"],
        "loadgen_cpu_wait_s": gen["cpu_wait_s"],
        "achieved_wall_rps": summary["achieved_rate_per_s"],
        "send_lag_p99_ms": _ms(summary["send_lag_s"].get("p99")),
        "loadgen_warnings": summary["warnings"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def proxy_child(urls: list[str], config: str, cpus: Sequence[int] = ()) -> ChildProcess:
    """``kvguard proxy`` (``config``) in front of ``urls``, as a child not yet started (under
    ``taskset -c`` on ``cpus`` when given)."""
    upstreams = [a for url in urls for a in ("--upstream", url)]
    return ChildProcess("proxy", lambda port: [
        sys.executable, "-m", "guard.cli", "proxy", *upstreams, "--config", config,
        # one generator's address stands for every client, and it holds R × a request's life
        # connections open (Little: ~4,000 at 2,000 req/s of 2 s requests, whatever the time
        # scale), so the per-client and total caps, sized for real clients, are lifted
        "--max-connections", "0", "--max-connections-per-client", "0",
        "--host", "127.0.0.1", "--port", str(port)],
        http_health, ready_pattern=r"kvguard proxy listening on (\S+)", cpus=cpus)


def wait_routable(url: str, num_replicas: int, timeout_s: float = 120.0) -> None:
    """Until the proxy at ``url`` routes to ``num_replicas`` replicas; RuntimeError past
    ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        replicas = httpx.get(url + "/kvguard/state", timeout=30, trust_env=False
                             ).json()["replicas"]
        if sum(r["routable"] for r in replicas) == num_replicas:
            return
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"the proxy routes to {sum(r['routable'] for r in replicas)} "
                               f"of {num_replicas} replicas after {timeout_s:g} s")
        time.sleep(0.5)


def client_connections(rate_gpu_rps: float, args: argparse.Namespace) -> int:
    """How many requests the load generator may have open at once: Little's law at the
    offered rate, every request as long as its SLO allows (the TTFT limit, then each of its
    most output tokens at the gap limit: a bound while the SLO is kept, sheds being short), and
    never fewer than 4,096 (the number in flight does not depend on the time scale: wall rate
    ÷ K × lifetime × K; the proxy holds two sockets per request, so 3,000 req/s of 32-token
    streams — 10,680 — fits a 20,000-descriptor limit only as the bound it is). Past its cap the
    generator holds a request back until one ends — the open-loop arrivals become a closed
    loop, the guard never sees the load offered, and the wait counts in the client's TTFT: at
    3,000 req/s through 256 replicas a fixed 4,096 held back up to ~2,300 requests, so `slo`
    shed nothing while 22 % of the clients' first tokens were late."""
    lifetime_s = args.e2e_ttft + LengthDist.parse(args.e2e_output_tokens).high * args.e2e_itl
    return max(4096, math.ceil(rate_gpu_rps * lifetime_s))


def max_in_flight(records: list) -> int:
    """The most requests the generator had sent and not yet seen end, at any instant."""
    events = sorted(e for r in records if r.sent_s is not None and r.e2e_s is not None
                    for e in ((r.sent_s, 1), (r.sent_s + r.e2e_s, -1)))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _load_args(url: str, fleet: dict, args: argparse.Namespace, out: Path) -> argparse.Namespace:
    k = args.time_scale
    p = argparse.ArgumentParser()
    configure_load(p)
    return p.parse_args([
        "--url", url, "--rate", repr(fleet["wall_rate_rps"]),
        "--duration", repr(fleet["duration_wall_s"]),
        "--warmup", repr(fleet["warmup_wall_s"]),
        "--prompt-tokens", args.e2e_prompt_tokens, "--output-tokens", args.e2e_output_tokens,
        "--ttft", repr(args.e2e_ttft * k), "--itl", repr(args.e2e_itl * k),
        "--seed", str(args.e2e_seed), "--timeout", repr(max(60.0, 6.0 * k)),
        "--drain-timeout", repr(max(30.0, 6.0 * k)),
        "--max-connections", str(client_connections(fleet["offered_gpu_rps"], args)),
        "--client", args.e2e_client, "--metrics-url", "none", "--out", str(out), "--quiet"])


def guard_config(path: str, args: argparse.Namespace) -> str:
    """The proxy's guard TOML at ``path``: ``slo`` with the class SLO, the state refresh and
    the guard's other durations of engine time times the time scale K — the queue's longest
    wait (``max_queue_wait_s``), how long the TTFT headroom holds after an overload shed
    (``pressure_hold_s``) and the stale rule's queue (``stale_queue_s``): left at their wall
    defaults, at K = 60 a queued request was cut after 0.5 GPU s and the headroom lasted
    0.08 GPU s after a shed, where the unscaled guard gives 30 and 5."""
    k = args.time_scale
    refresh_s = args.e2e_refresh_s * k
    slo = SloPolicy()
    return write_guard_config(
        path, policy="slo", ttft_s=args.e2e_ttft * k, itl_s=args.e2e_itl * k,
        settings={"refresh_interval_s": refresh_s, "max_staleness_s": 20 * refresh_s,
                  "max_queue_wait_s": GuardConfig.max_queue_wait_s * k},
        policy_params={"pressure_hold_s": slo.pressure_hold_s * k,
                       "stale_queue_s": slo.stale_queue_s * k},
        extra_toml=f"[proxy]\nread_timeout_s = {max(60.0, 6.0 * k)!r}\n")


def _run_fleet(fleet: dict, args: argparse.Namespace, directory: Path, c_gpu_rps: float) -> dict:
    k, n = args.time_scale, fleet["replicas"]
    config = guard_config(str(directory / f"guard-{n}.toml"), args)
    fleet_args = ("--state-time-scale", repr(k), "--state-model", args.e2e_model,
                  "--state-gpu", args.e2e_gpu)
    with state_only_fleet(n, fleet_args) as (fleet_proc, urls), contextlib.ExitStack() as stack:
        proxy = proxy_child(urls, config)
        stack.callback(proxy.terminate)
        proxy.start(300)
        wait_routable(proxy.url, n)
        out = directory / f"load-{n}"
        proxy_0, fleet_0, t0 = cpu_s(proxy.pid), cpu_s(fleet_proc.pid), time.monotonic()
        summary = flood(_load_args(proxy.url, fleet, args, out), fleet["wall_rate_rps"], out)
        elapsed_s = time.monotonic() - t0
        records = read_records(out / "requests.jsonl")
        row = fleet_row(records, summary, fleet, k, c_gpu_rps)
        row["client_connections"] = client_connections(fleet["offered_gpu_rps"], args)
        row["client_max_in_flight"] = max_in_flight(records)
        if row["client_max_in_flight"] > row["client_connections"]:
            row["loadgen_warnings"].append(
                f"up to {row['client_max_in_flight']} requests in flight for the generator's "
                f"{row['client_connections']} connections: requests waited for one before "
                f"they were sent, and their TTFT counts that wait")
        row["proxy_cores"] = round((cpu_s(proxy.pid) - proxy_0) / elapsed_s, 3)
        row["fleet_cores"] = round((cpu_s(fleet_proc.pid) - fleet_0) / elapsed_s, 3)
        row["load_wall_s"] = round(elapsed_s, 1)
    return row


def run_e2e(args: argparse.Namespace) -> dict:
    """Every fleet of the plan, one after the other; the report (also ``e2e.json`` in the
    output folder)."""
    report = plan(args)
    out = Path(args.e2e_out or f"runs/scale-e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        report["fleets"] = [_run_fleet(f, args, out if args.e2e_out else Path(scratch),
                                       report["c_per_replica_gpu_rps"])
                            for f in report["fleets"]]
    ref = report["fleets"][0]["goodput_over_c"]
    for row in report["fleets"]:
        row["goodput_over_c_vs_first"] = row["goodput_over_c"] / ref if ref else None
    report["command"] = " ".join(["kvguard", "bench", "scale", *sys.argv[3:]])
    (out / "e2e.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def cell(x: float | None, spec: str = ".1f") -> str:
    """A table cell: ``x`` formatted by ``spec``, a dash when there is none."""
    return "—" if x is None else format(x, spec)


def render(report: dict) -> str:
    """The report as a Markdown table, one row per fleet."""
    f = cell
    lines = [f"{report['rate_gpu_rps']:g} req/s at time scale {report['time_scale']:g} "
             f"(offered / C = {report['offered_over_c']:.3f}; C = "
             f"{report['c_per_replica_gpu_rps']:.2f} req/s per replica)", "",
             "| replicas | offered (wall req/s) | 200 / 429 / 503 / other | shed p50 / p99 ms | "
             "window offered / C | goodput / C | vs first | good / offered | TTFT p50 / p99 s | gap p50 / p99 ms "
             "| proxy cores | fleet cores | loadgen % core | loadgen flagged |",
             "|---:|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in report["fleets"]:
        s = r["statuses"]
        other = r["offered"] - sum(s.get(c, 0) for c in ("200", "429", "503"))
        gap = [None if x is None else 1000 * x for x in (r["gap_p50_s"], r["gap_p99_s"])]
        lines.append(
            f"| {r['replicas']} | {r['offered']} ({r['wall_rate_rps']:.2f}) | {s.get('200', 0)} / "
            f"{s.get('429', 0)} / {s.get('503', 0)} / {other} | {f(r['shed_p50_ms'])} / "
            f"{f(r['shed_p99_ms'])} | {f(r['window_offered_over_c'], '.3f')} | "
            f"{f(r['goodput_over_c'], '.3f')} | "
            f"{f(r['goodput_over_c_vs_first'], '.3f')} | {f(r['good_over_offered'], '.3f')} | "
            f"{f(r['ttft_p50_s'], '.3f')} / {f(r['ttft_p99_s'], '.3f')} | {f(gap[0])} / "
            f"{f(gap[1])} | {r['proxy_cores']:.2f} | {r['fleet_cores']:.2f} | "
            f"{f(r['loadgen_cpu_percent'], '.0f')} | "
            f"{'yes: ' + '; '.join(r['loadgen_warnings']) if r['loadgen_warnings'] else 'no'} |")
    return "\n".join(lines)
