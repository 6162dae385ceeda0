"""``kvguard bench scale --shed-flood``: how fast one proxy in front of a saturated fleet of
state-only replicas says no to a flood, in wall time.

The end-to-end run (:mod:`chaos.bench.scale_e2e`) offers its rate divided by a time scale, so a
shed there is timed at 1 ÷ K of the rate. A flood of sheds needs no time scale: nothing it is
offered is admitted, so no stream has to be relayed. This starts ``kvguard fleet --state-only``
with ``--flood-replicas`` replicas of ``--flood-kv-blocks`` KV blocks each, and holds every
replica full with one long request sent to it directly (not through the proxy: to the guard it
is another client's sequence, seen only in the replica's state): ``--hold-prompt-tokens`` +
``--hold-output-tokens`` tokens, non-streamed, so the replica sends nothing until it ends and
the held load costs no relayed tokens. Its blocks are committed from its first step (the
guard counts what a running sequence will still grow into), so a flood request finds no room
on any replica, and the forecast wait for blocks (the held sequence's remaining decode steps)
is far past the class TTFT: ``slo`` sheds it at once (503 ``no_kv_capacity``), over its
bounded candidate set as any overload shed.

The replicas run at ``--flood-time-scale`` K (default 50), and the class SLO is K times
``--flood-ttft`` and ``--flood-itl`` (as in the end-to-end run), only so that holding them
costs the fleet process little: at K = 1 it must apply 256 × ~210 decode steps a second on one
event loop, fell behind on two shared cores, and the proxy then saw stale state and answered
``no_replica`` and ``queue_timeout`` after seconds (measured once, 2026-12-06 10:06 UTC). The
shed path does not depend on K — the flood is offered at ``--flood-rate`` wall req/s and each
shed is timed in wall time — and the proxy's state refresh is its default, 10 Hz wall, so it
keeps 256 replicas' state as it would unscaled (at K = 50 most events are heartbeats, as for
an idle fleet, so this is the state cost of ``kvguard bench state-cpu``, not of busy replicas).

The fleet serves every replica from one event loop, so the state streams a proxy opens at
once would stay in step for good and each refresh would bring the proxy all of the fleet's
events together (and the fleet process would encode them together); separate replica processes
drift apart. By default each replica's stream sends at its own phase of the interval
(``--flood-stream-phase spread``, ``kvguard fleet --state-stream-phase``); ``aligned`` keeps
them in step (what this bench did before; measured in docs/benchmarks.md §17) for a guard that
asks no phase of its own: kvguard's proxy now asks each stream for one (``?phase=``), which
wins, so it spreads an aligned fleet itself.

One ``kvguard proxy`` (``slo``, the state refreshed every ``--flood-refresh-s`` — default
0.1 s, the proxy's own — over the replicas' streams, the connection caps lifted as in the
end-to-end run) is then offered
``--flood-rate`` req/s (open loop, Poisson) for ``--flood-duration`` seconds of short prompts
by ``kvguard load``'s generator in this process. Reported: requests offered and answered,
admitted, shed, refused and unanswered, the shed latency at the client (p50/p99/max, wall),
the proxy's and the fleet process's cores over the flood (and the proxy's over 2 s before it,
with only the state to keep), the proxy's CPU per offered request, how long the OS kept the
proxy's main thread waiting for a CPU over the flood (Linux's run-queue wait, as the
generator measures its own), the generator's CPU and whether it flagged itself (kept waiting for a CPU, behind its schedule). The generator, the
proxy and the fleet share the machine's cores, unless ``--flood-pin-proxy-cpu N`` gives the
proxy CPU N of its own (started under ``taskset -c N``) and this process (the generator) and
the fleet, which it starts, the other CPUs: the guard's own capacity, apart from the
contention for a CPU. Each row records the CPUs each of the three ran on.

    kvguard bench scale --shed-flood --flood-pin-proxy-cpu 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from chaos.bench.gateway import cpu_pinning, on_other_cpus
from chaos.bench.scale_e2e import cell, proxy_child, wait_routable
from chaos.bench.sheds import flood, shed_row
from chaos.bench.state_cpu import cpu_s, state_only_fleet
from chaos.load import run_queue_wait_s
from chaos.load_cli import configure as configure_load
from chaos.replica import write_guard_config
from chaos.report import read_records
from chaos.state_fleet import STREAM_PHASES

__all__ = ["add_arguments", "refuse_without_flood", "run_flood", "flood_row", "render",
           "hold_request"]

_BLOCK_SIZE = 16  # chaos.state_replica.StateReplica's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("shed flood (--shed-flood)")
    g.add_argument("--shed-flood", action="store_true",
                   help="run the shed flood instead: a saturated state-only fleet behind one "
                        "proxy, offered --flood-rate req/s in wall time")
    g.add_argument("--flood-replicas", type=int, default=256, help="replicas (default 256)")
    g.add_argument("--flood-rate", type=float, default=2000.0,
                   help="offered req/s, wall time (default 2000)")
    g.add_argument("--flood-duration", type=float, default=3.0,
                   help="seconds of arrivals (default 3)")
    g.add_argument("--flood-prompt-tokens", default="64",
                   help="flood prompt tokens (N or LO:HI; default 64)")
    g.add_argument("--flood-output-tokens", default="16",
                   help="flood output tokens (N or LO:HI; default 16)")
    g.add_argument("--hold-prompt-tokens", type=int, default=96,
                   help="the held request's prompt tokens (default 96)")
    g.add_argument("--hold-output-tokens", type=int, default=3904,
                   help="the held request's max_tokens (default 3904: prompt + output = "
                        "4,000 tokens, 250 blocks, ~18 s of decode steps at time scale 1)")
    g.add_argument("--flood-kv-blocks", type=int, default=None,
                   help="KV blocks per replica (default: exactly the held request's)")
    g.add_argument("--flood-time-scale", type=float, default=50.0,
                   help="the replicas' time scale; the class SLO is scaled by it too "
                        "(default 50: cheap to hold, see the module docstring)")
    g.add_argument("--flood-ttft", type=float, default=1.0,
                   help="class TTFT limit, GPU seconds (x the time scale)")
    g.add_argument("--flood-itl", type=float, default=0.08,
                   help="class gap limit, GPU seconds (x the time scale)")
    g.add_argument("--flood-refresh-s", type=float, default=0.1,
                   help="the proxy's state refresh interval, wall seconds (default 0.1, the "
                        "proxy's own; its max_staleness_s is 20 x that)")
    g.add_argument("--flood-stream-phase", choices=STREAM_PHASES, default="spread",
                   help="the replicas' state streams: each at its own phase of the interval "
                        "(default spread, as separate replicas drift apart) or all in step "
                        "(aligned: a proxy that asks no phase of its own gets every "
                        "replica's event at once; kvguard's asks one per stream, which wins); "
                        "kvguard fleet --state-stream-phase")
    g.add_argument("--flood-pin-proxy-cpu", type=int, default=None, metavar="N",
                   help="the proxy on CPU N of its own (taskset), the fleet and the load "
                        "generator on the other CPUs (default: all share every CPU); needs 2 "
                        "CPUs or more")
    g.add_argument("--flood-client", choices=("raw", "aiohttp"), default="raw",
                   help="the load generator's client (default raw: least CPU per request)")
    g.add_argument("--flood-seed", type=int, default=0, help="arrival seed")
    g.add_argument("--flood-out", default=None,
                   help="output folder (default runs/scale-flood-<time>)")


def refuse_without_flood(args: argparse.Namespace) -> None:
    """ValueError naming the first flood flag given without ``--shed-flood`` (it would do
    nothing)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for key, default in vars(parser.parse_args([])).items():
        if key != "shed_flood" and getattr(args, key, default) != default:
            raise ValueError(f"--{key.replace('_', '-')} applies only with --shed-flood")


def _num_kv_blocks(args: argparse.Namespace) -> int:
    """KV blocks per replica: the flag, or exactly the held request's whole length."""
    if args.flood_kv_blocks is not None:
        return args.flood_kv_blocks
    return -(-(args.hold_prompt_tokens + args.hold_output_tokens) // _BLOCK_SIZE)


def _check(args: argparse.Namespace) -> None:
    if args.flood_replicas < 1 or args.hold_prompt_tokens < 1 or args.hold_output_tokens < 1:
        raise ValueError("--flood-replicas, --hold-prompt-tokens and --hold-output-tokens "
                         "must be >= 1")
    if not (args.flood_rate > 0 and args.flood_duration > 0 and args.flood_time_scale > 0
            and args.flood_ttft > 0 and args.flood_itl > 0 and args.flood_refresh_s > 0):
        raise ValueError("--flood-rate, --flood-duration, --flood-time-scale, --flood-ttft, "
                         "--flood-itl and --flood-refresh-s must be > 0")
    if args.flood_kv_blocks is not None and args.flood_kv_blocks < 1:
        raise ValueError("--flood-kv-blocks must be >= 1")


def hold_request(model: str, num_prompt_tokens: int, max_tokens: int, request_id: str) -> bytes:
    """One non-streamed completion request as HTTP/1.1 bytes (prompt as token ids)."""
    body = json.dumps({"model": model, "prompt": [7] * num_prompt_tokens,
                       "max_tokens": max_tokens, "stream": False}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: {request_id}\r\n\r\n").encode() + body


@contextlib.contextmanager
def _held(urls: list[str], args: argparse.Namespace):
    """One long request sent to each replica, its connection kept open (and unread: the
    answer comes when it ends) until the block exits, then closed (the replica aborts it)."""
    socks = []
    try:
        for index, url in enumerate(urls):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=10)
            socks.append(sock)
            sock.sendall(hold_request("llama-7b", args.hold_prompt_tokens,
                                      args.hold_output_tokens, f"hold-{index}"))
        yield
    finally:
        for sock in socks:
            sock.close()


def _wait_full(url: str, num_replicas: int, timeout_s: float = 60.0) -> float:
    """Seconds until the proxy's view shows every replica holding a sequence (free blocks
    below its total); RuntimeError past ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        replicas = httpx.get(url + "/kvguard/state", timeout=30, trust_env=False
                             ).json()["replicas"]
        full = sum(r["num_free_blocks"] is not None and r["num_total_blocks"] is not None
                   and r["num_free_blocks"] < r["num_total_blocks"] for r in replicas)
        if full == num_replicas:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the proxy sees {full} of {num_replicas} replicas holding "
                               f"a sequence after {timeout_s:g} s")
        time.sleep(0.2)


def _load_args(url: str, args: argparse.Namespace, out: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_load(p)
    return p.parse_args([
        "--url", url, "--rate", repr(args.flood_rate), "--duration", repr(args.flood_duration),
        "--prompt-tokens", args.flood_prompt_tokens,
        "--output-tokens", args.flood_output_tokens,
        "--ttft", repr(args.flood_ttft * args.flood_time_scale),
        "--itl", repr(args.flood_itl * args.flood_time_scale),
        "--seed", str(args.flood_seed), "--timeout", "30",
        "--drain-timeout", "30", "--max-connections", "4096", "--client", args.flood_client,
        "--metrics-url", "none", "--out", str(out), "--quiet"])


def flood_row(records: list, summary: dict, args: argparse.Namespace) -> dict:
    """The flood's counts and shed latencies (ms, wall) from its load records and summary."""
    sheds = shed_row(records, args.flood_rate, args.flood_duration)
    gen = summary["load_generator"]
    reasons: dict[str, int] = {}
    for r in records:
        if r.reason is not None:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1

    def ms(seconds):
        return None if seconds is None else round(1000 * seconds, 3)
    return {
        "replicas": args.flood_replicas, "offered_rps": args.flood_rate,
        "offered": sheds["offered"], "answered": sheds["answered"],
        "admitted": sheds["admitted"], "shed": sheds["shed"], "refused": sheds["refused"],
        "no_answer": sheds["no_answer"], "reasons": dict(sorted(reasons.items())),
        "shed_p50_ms": ms(sheds["shed_p50_s"]), "shed_p99_ms": ms(sheds["shed_p99_s"]),
        "shed_max_ms": ms(sheds["shed_max_s"]),
        "achieved_rps": summary["achieved_rate_per_s"],
        "send_lag_p99_ms": ms(summary["send_lag_s"].get("p99")),
        "loadgen_cpu_percent": gen["cpu_percent_of_one_core"],
        "loadgen_cpu_wait_s": gen["cpu_wait_s"], "loadgen_warnings": summary["warnings"],
    }


def run_flood(args: argparse.Namespace) -> dict:
    """The whole run; its report (also ``flood.json`` in the output folder). With
    ``--flood-pin-proxy-cpu``, this process runs on the other CPUs while it lasts (the fleet,
    started from it, inherits them) and gets its own CPUs back afterwards."""
    _check(args)
    pinning = cpu_pinning(args.flood_pin_proxy_cpu, flag="--flood-pin-proxy-cpu")
    out = Path(args.flood_out or f"runs/scale-flood-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    with on_other_cpus(pinning) as proxy_cpus:
        row = _run_flood(args, out, proxy_cpus)
    row["command"] = " ".join(["kvguard", "bench", "scale", *sys.argv[3:]])
    (out / "flood.json").write_text(json.dumps(row, indent=1) + "\n")
    return row


def _run_flood(args: argparse.Namespace, out: Path, proxy_cpus: tuple[int, ...]) -> dict:
    num_blocks = _num_kv_blocks(args)
    fleet_args = ("--state-time-scale", repr(args.flood_time_scale),
                  "--state-kv-blocks", str(num_blocks),
                  "--state-stream-phase", args.flood_stream_phase)
    with tempfile.TemporaryDirectory() as scratch, \
            state_only_fleet(args.flood_replicas, fleet_args) as (fleet_proc, urls), \
            contextlib.ExitStack() as stack:
        k = args.flood_time_scale
        refresh_s = args.flood_refresh_s
        config = write_guard_config(str(Path(scratch) / "guard.toml"), policy="slo",
                                    ttft_s=args.flood_ttft * k, itl_s=args.flood_itl * k,
                                    settings={"refresh_interval_s": refresh_s,
                                              "max_staleness_s": max(2.0, 20 * refresh_s)})
        proxy = proxy_child(urls, config, cpus=proxy_cpus)
        stack.callback(proxy.terminate)
        proxy.start(300)
        # where each ran, as the kernel has it (the generator is this process)
        row_cpus = {"proxy_cpus": sorted(os.sched_getaffinity(proxy.pid)),
                    "fleet_cpus": sorted(os.sched_getaffinity(fleet_proc.pid)),
                    "loadgen_cpus": sorted(os.sched_getaffinity(0))}
        wait_routable(proxy.url, args.flood_replicas)
        stack.enter_context(_held(urls, args))
        full_after_s = _wait_full(proxy.url, args.flood_replicas)
        idle_0, t_idle = cpu_s(proxy.pid), time.monotonic()
        time.sleep(2.0)  # the proxy with only the state to keep
        proxy_idle_cores = (cpu_s(proxy.pid) - idle_0) / (time.monotonic() - t_idle)
        proxy_0, fleet_0, t0 = cpu_s(proxy.pid), cpu_s(fleet_proc.pid), time.monotonic()
        proxy_wait_0 = run_queue_wait_s(proxy.pid)
        summary = flood(_load_args(proxy.url, args, out), args.flood_rate, out)
        elapsed_s = time.monotonic() - t0
        row = flood_row(read_records(out / "requests.jsonl"), summary, args)
        row.update(row_cpus)
        proxy_s = cpu_s(proxy.pid) - proxy_0
        proxy_wait_1 = run_queue_wait_s(proxy.pid)
        row["proxy_cpu_wait_s"] = (None if proxy_wait_0 is None or proxy_wait_1 is None
                                   else round(proxy_wait_1 - proxy_wait_0, 4))
        row["proxy_cores"] = round(proxy_s / elapsed_s, 3)
        row["proxy_idle_cores"] = round(proxy_idle_cores, 3)
        # the flood's share: the proxy's CPU less what keeping the state cost it before
        row["proxy_cpu_us_per_request"] = round(
            1e6 * max(0.0, proxy_s - proxy_idle_cores * elapsed_s) / max(1, row["offered"]), 1)
        row["fleet_cores"] = round((cpu_s(fleet_proc.pid) - fleet_0) / elapsed_s, 3)
        row["load_wall_s"] = round(elapsed_s, 2)
        row["full_after_s"] = round(full_after_s, 2)
    row["kv_blocks_per_replica"] = num_blocks
    row["refresh_s"] = args.flood_refresh_s
    row["stream_phase"] = args.flood_stream_phase
    return row


def render(row: dict) -> str:
    """The report as a one-row Markdown table."""
    f = cell
    flagged = row["loadgen_warnings"]
    return "\n".join([
        f"{row['offered_rps']:g} req/s for a saturated fleet of {row['replicas']} state-only "
        f"replicas ({row['kv_blocks_per_replica']} KV blocks each, one held request); CPUs: "
        f"proxy {row['proxy_cpus']}, fleet {row['fleet_cpus']}, generator "
        f"{row['loadgen_cpus']}", "",
        "| offered | answered | admitted | shed | refused | no answer | shed p50 / p99 / max ms "
        "| proxy cores (idle) | proxy µs / request | proxy kept off a CPU s "
        "| fleet cores | loadgen % core "
        "| loadgen flagged |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|",
        f"| {row['offered']} | {row['answered']} | {row['admitted']} | {row['shed']} | "
        f"{row['refused']} | {row['no_answer']} | {f(row['shed_p50_ms'])} / "
        f"{f(row['shed_p99_ms'])} / {f(row['shed_max_ms'])} | {row['proxy_cores']:.2f} "
        f"({row['proxy_idle_cores']:.2f}) | {row['proxy_cpu_us_per_request']:.0f} | "
        f"{f(row['proxy_cpu_wait_s'], '.3f')} | "
        f"{row['fleet_cores']:.2f} | {f(row['loadgen_cpu_percent'], '.0f')} | "
        f"{'yes: ' + '; '.join(flagged) if flagged else 'no'} |"])
