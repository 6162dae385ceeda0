"""``kvguard bench state-cpu``: what keeping a fleet's state fresh costs a real proxy process.

Starts ``kvguard fleet --replicas N --state-only --proxies 0`` (every replica state-only, in
one process), then for each ``--sources`` value a ``kvguard proxy`` in front of all of them
with that ``--state-source`` (and ``refresh_interval_s`` ``--refresh-s``), idle: after
``--settle-s`` it reads the proxy's and the fleet process's CPU time (utime + stime,
``/proc/PID/stat``) over ``--window-s`` seconds and, at the end, how old the proxy's view of
each replica is (``state_age_s`` in its ``/kvguard/state``). ``--repeats`` alternates the
sources that many times (the machine's load moves between runs: compare neighbours).

Idle replicas publish small documents; what a busy replica's state costs to ingest is
``kvguard bench scale``'s (in-process, by running sequences). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import httpx

from chaos.child import ChildProcess
from chaos.topology import http_health

__all__ = ["configure", "run", "state_only_fleet", "cpu_s"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=256,
                        help="state-only replicas (default 256)")
    parser.add_argument("--sources", default="kvguard,stream",
                        help="proxy --state-source values to compare (default kvguard,stream)")
    parser.add_argument("--refresh-s", type=float, default=0.1,
                        help="the proxies' refresh_interval_s (default 0.1: 10 Hz)")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="wait after a proxy is ready before measuring (default 3)")
    parser.add_argument("--window-s", type=float, default=10.0,
                        help="CPU measured over this many seconds (default 10)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="times each source is measured, alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(urls: list[str], source: str, config: str, fleet_pid: int,
             args: argparse.Namespace) -> dict:
    upstreams = [a for url in urls for a in ("--upstream", url)]
    proxy = ChildProcess("proxy", lambda port: [
        sys.executable, "-m", "guard.cli", "proxy", *upstreams, "--state-source", source,
        "--config", config, "--host", "127.0.0.1", "--port", str(port)],
        http_health, ready_pattern=r"kvguard proxy listening on (\S+)")
    proxy.start(300)
    try:
        time.sleep(args.settle_s)
        proxy_0, fleet_0, start_s = cpu_s(proxy.pid), cpu_s(fleet_pid), time.monotonic()
        time.sleep(args.window_s)
        proxy_1, fleet_1, end_s = cpu_s(proxy.pid), cpu_s(fleet_pid), time.monotonic()
        replicas = httpx.get(proxy.url + "/kvguard/state", timeout=30,
                             trust_env=False).json()["replicas"]
    finally:
        proxy.terminate()
    ages = sorted(r["state_age_s"] for r in replicas if r["state_age_s"] is not None)
    elapsed_s = end_s - start_s
    return {"source": source, "proxy_cores": round((proxy_1 - proxy_0) / elapsed_s, 3),
            "fleet_cores": round((fleet_1 - fleet_0) / elapsed_s, 3),
            "routable": sum(r["routable"] for r in replicas), "replicas": len(replicas),
            "state_age_p50_s": ages[len(ages) // 2] if ages else None,
            "state_age_max_s": ages[-1] if ages else None}


@contextlib.contextmanager
def state_only_fleet(num_replicas: int, extra_args: Sequence[str] = (),
                     ) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """``kvguard fleet --state-only`` (with ``extra_args``) as a child: its process and replica
    URLs; killed by its pid on the way out."""
    proc = subprocess.Popen([sys.executable, "-m", "guard.cli", "fleet", "--replicas",
                             str(num_replicas), "--state-only", "--proxies", "0", *extra_args],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        urls = []
        deadline_s = time.monotonic() + 600
        while time.monotonic() < deadline_s:
            line = proc.stdout.readline()
            if not line or line.startswith("fleet ready"):
                break
            if line.startswith("replica-"):
                urls.append(line.split()[1])
        if len(urls) != num_replicas:
            raise RuntimeError(f"kvguard fleet started {len(urls)} of {num_replicas} replicas")
        yield proc, urls
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(args: argparse.Namespace) -> int:
    sources = [s for s in args.sources.split(",") if s]
    if args.replicas < 1 or args.repeats < 1 or not sources or not args.window_s > 0 \
            or not args.refresh_s > 0 or args.settle_s < 0:
        raise ValueError("--replicas and --repeats must be >= 1, --sources non-empty, "
                         "--window-s and --refresh-s > 0, --settle-s >= 0")
    rows = []
    with tempfile.TemporaryDirectory() as directory, \
            state_only_fleet(args.replicas) as (fleet, urls):
        config = os.path.join(directory, "proxy.toml")
        with open(config, "w") as fh:
            fh.write(f"refresh_interval_s = {args.refresh_s}\n")
        for _ in range(args.repeats):
            for source in sources:
                row = _measure(urls, source, config, fleet.pid, args)
                rows.append(row)
                if not args.json:
                    print(f"{row['source']:>8}  proxy {row['proxy_cores']:.3f} cores  fleet "
                          f"{row['fleet_cores']:.3f} cores  routable {row['routable']}/"
                          f"{row['replicas']}  state age p50 {row['state_age_p50_s']:.3f} s "
                          f"max {row['state_age_max_s']:.3f} s", flush=True)
    if args.json:
        print(json.dumps({"replicas": args.replicas, "refresh_s": args.refresh_s,
                          "rows": rows}, indent=1))
    return 0
