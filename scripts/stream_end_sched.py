"""Where a proxied stream's added latency goes, token by token, from the kernel scheduler's view.

    python scripts/stream_end_sched.py [--requests 300] [--max-tokens 8]

Starts one sim replica and one ``kvguard proxy`` on its defaults (``chaos.topology``), then
runs a client under ``perf sched record -k CLOCK_MONOTONIC``: one streamed completion at a
time, directly and through the proxy alternately, stamping each read with ``time.monotonic``
(the clock the trace uses). Prints, per content token and for the stream's end, the median
time the proxy added, and at the stream's end (and mid-stream, for comparison) from the trace:
how long the client waited between its wake-up and running (``sched delay``), how often it ran
on the proxy's core right after the proxy's time slice, and how long that slice ran.

Needs ``perf`` with access to the scheduler tracepoints (root, or
``kernel.perf_event_paranoid`` <= -1). A diagnostic, not a benchmark: the trace itself costs
time. Only loopback; every child is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_CONTENT = re.compile(rb'"text"\s*:\s*"(?!")')
_SLICE = re.compile(r"^\s*(\d+\.\d+)\s+\[(\d+)\]\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="streams per target")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--client", nargs=3, metavar=("DIRECT", "PROXY", "OUT"),
                        help=argparse.SUPPRESS)  # the traced client (run under perf)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 2:
        parser.error("--requests must be >= 1 and --max-tokens >= 2")
    if args.client:
        return _client(*args.client, args.requests, args.max_tokens)
    if shutil.which("perf") is None:
        parser.error("perf is not on PATH (linux-tools)")
    from chaos.topology import Topology, TopologySpec

    with tempfile.TemporaryDirectory(prefix="kvguard-sched-") as work, \
            Topology(TopologySpec(num_replicas=1, num_proxies=1)) as fleet:
        direct, proxy = fleet.replica_urls[0], fleet.proxy_urls[0]
        proxy_pid = fleet.proxies[0].pid
        stamps, trace = Path(work, "stamps.json"), Path(work, "sched.data")
        client = [sys.executable, __file__, "--requests", str(args.requests), "--max-tokens",
                  str(args.max_tokens), "--client", direct, proxy, str(stamps)]
        print(f"tracing {args.requests} streams per target ...", file=sys.stderr, flush=True)
        subprocess.run(["perf", "sched", "record", "-k", "CLOCK_MONOTONIC", "-o", str(trace),
                        "--", *client], check=True, stdout=subprocess.DEVNULL)
        text = subprocess.run(["perf", "sched", "timehist", "-i", str(trace)], check=True,
                              capture_output=True, text=True).stdout
        recorded = json.loads(stamps.read_text())
    _report(recorded, _slices(text), proxy_pid, args.max_tokens)
    return 0


def _client(direct: str, proxy: str, out: str, requests: int, max_tokens: int) -> int:
    import httpx

    body = json.dumps({"model": "llama-7b", "prompt": "The proxy bench says hello",
                       "max_tokens": max_tokens, "stream": True}).encode()
    clients = {name: httpx.Client(base_url=url, timeout=30.0, trust_env=False)
               for name, url in (("direct", direct), ("proxy", proxy))}
    streams = []
    warmup = 20
    try:
        for i in range(warmup + requests):
            for name, client in clients.items():
                sent_s, reads = time.monotonic(), []
                with client.stream("POST", "/v1/completions", content=body,
                                   headers={"content-type": "application/json"}) as response:
                    for chunk in response.iter_raw():
                        if _CONTENT.search(chunk):
                            reads.append(time.monotonic())
                    end_s = time.monotonic()
                if response.status_code != 200:
                    raise RuntimeError(f"{name}: HTTP {response.status_code}")
                if i >= warmup:
                    streams.append({"target": name, "sent_s": sent_s, "tokens_s": reads,
                                    "end_s": end_s})
    finally:
        for client in clients.values():
            client.close()
    Path(out).write_text(json.dumps({"pid": os.getpid(), "streams": streams}))
    return 0


def _slices(text: str) -> dict[str, list[tuple[float, float, float, int]]]:
    """Per task (``name[tid/pid]`` as perf prints it): its time slices as (start, end,
    sched delay, cpu), in seconds, sorted by start."""
    slices: dict[str, list[tuple[float, float, float, int]]] = {}
    for line in text.splitlines():
        match = _SLICE.match(line)
        if match is None:
            continue
        end_s, cpu, task = float(match[1]), int(match[2]), match[3]
        run_s = float(match[6]) / 1000
        slices.setdefault(task, []).append((end_s - run_s, end_s, float(match[5]) / 1000, cpu))
    for runs in slices.values():
        runs.sort()
    return slices


def _task(slices: dict, pid: int) -> tuple[list, list[float]]:
    """The main thread's slices of process ``pid``, and their start times (for bisection)."""
    for task, runs in slices.items():
        if task.endswith(f"[{pid}]"):
            return runs, [r[0] for r in runs]
    raise RuntimeError(f"no scheduler events for pid {pid} in the trace")


def _slice_at(task: tuple[list, list[float]], at_s: float) -> tuple[float, float, float, int]:
    """The last slice of ``task`` (from :func:`_task`) that started at or before ``at_s``."""
    runs, starts = task
    return runs[max(bisect.bisect_right(starts, at_s) - 1, 0)]


def _report(recorded: dict, slices: dict, proxy_pid: int, max_tokens: int) -> None:
    client_runs, proxy_runs = _task(slices, recorded["pid"]), _task(slices, proxy_pid)
    points = {"direct": [], "proxy": []}  # per stream: each token's time, then the end
    for stream in recorded["streams"]:
        if len(stream["tokens_s"]) == max_tokens:
            points[stream["target"]].append(stream)
    labels = [f"token {k + 1}" for k in range(max_tokens)] + ["end"]
    print(f"{'':<10} {'added p50':>10} {'client sched delay':>19} {'client on proxy core':>21} "
          f"{'proxy slice':>12}")
    for k, label in enumerate(labels):
        at = [_at(s, k) for s in points["proxy"]]
        added = statistics.median(a - s["sent_s"] for a, s in zip(at, points["proxy"],
                                                                   strict=True)) - \
            statistics.median(_at(s, k) - s["sent_s"] for s in points["direct"])
        delays, same, proxy_slice = [], 0, []
        for when in at:
            client = _slice_at(client_runs, when)
            delays.append(client[2])
            before = _slice_at(proxy_runs, client[0] + 2e-5)
            proxy_slice.append(before[1] - before[0])
            same += before[3] == client[3] and abs(client[0] - before[1]) < 5e-6
        print(f"{label:<10} {1000 * added:8.3f}ms {1e6 * statistics.median(delays):16.0f} µs "
              f"{same:>12} of {len(at):<5} {1e6 * statistics.median(proxy_slice):9.0f} µs")


def _at(stream: dict, k: int) -> float:
    tokens = stream["tokens_s"]
    return tokens[k] if k < len(tokens) else stream["end_s"]


if __name__ == "__main__":
    sys.exit(main())
