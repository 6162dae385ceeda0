"""``kvguard bench gateway``: what ``kvguard epp`` adds behind Envoy, beside the alternatives.

**Added latency.** One sim replica, reached directly and through each target, one streamed
completion of ``--max-tokens`` tokens at a time, the targets interleaved request by request in
a seeded shuffled order with a ``--gap-ms`` pause before each (as ``kvguard bench proxy``
measures, with its code): TTFT (first content token at the client) and end-to-end, median and
p99, and each minus the direct figure (and, for the ext_proc rows, the median over rounds of
each request's figure minus Envoy alone's in the same round: paired, steadier on a busy
machine); CPU per request is net of each process's idle CPU, and
for Envoy + EPP it is the EPP's (Envoy's own is about Envoy alone's). Targets: Envoy alone (the same Envoy config without the
ext_proc filter, a static cluster to the replica), Envoy + ``kvguard epp`` (``slo``), ``kvguard
proxy`` (``slo``, its defaults), and LiteLLM proxy with ``--litellm`` (its own virtualenv, as
in ``kvguard bench proxy``). The EPP's cost is its row minus Envoy alone's. Beside it, Envoy +
``chaos.bench.ext_proc_floor``: an ext_proc server on grpc.aio in the same processing modes
that decides nothing — what the protocol itself costs from Python; the EPP's own share is its
row minus that one. And Envoy + ``kvguard epp`` on ``deploy/envoy/envoy-split.yaml`` (its own
EPP): the decision filter for the request, the response sent to an observer filter in
observability mode, off the first token's path. For both EPP rows it prints how many of the
streams the EPP's tickets saw completed (the split one's through its observer).

**Decisions per second.** ``--rate-s`` seconds of ``--concurrency`` closed-loop clients sending
non-streamed 1-token completions through Envoy + one EPP to an instant sim replica (time scale
0): the requests per second that came back 200 (every one decided by the EPP), and the EPP's
CPU per decision.

**The EPP on a CPU of its own** (``--pin-epp-cpu N``): every ext_proc server (the floor and
each ``kvguard epp``) runs on CPU ``N`` only, and everything else the bench runs — Envoy, the
replica, ``kvguard proxy``, LiteLLM and the bench's own client — on the other CPUs, for every
row alike (Envoy alone included): what a deployment with the EPP in a pod of its own sees,
on one machine.

    kvguard bench gateway --requests 300 --rate-s 10 --out gateway.json
    kvguard bench gateway --requests 300 --rate-s 10 --pin-epp-cpu 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from chaos.bench.litellm_proxy import ensure_venv, litellm_child
from chaos.bench.proxy import _KEY, _cpu_s, _measure_all, _print_latency
from chaos.child import ChildProcess
from chaos.envoy_front import accepts_connections, envoy_child, epp_child, epp_metrics_url
from chaos.replica import exit_on_sigterm
from chaos.topology import Topology, TopologySpec, free_port, http_health

__all__ = ["CpuPinning", "configure", "cpu_pinning", "run"]

MODEL = "llama-7b"
FLOOR = "envoy + ext_proc floor"
SPLIT = "envoy + kvguard epp (split observer)"
_CONFIG = 'policy = "slo"\n'


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300,
                        help="latency requests per target (0: skip the latency part)")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured requests per target")
    parser.add_argument("--max-tokens", type=int, default=8,
                        help="tokens per streamed completion")
    parser.add_argument("--gap-ms", type=float, default=3.0,
                        help="pause before each latency request")
    parser.add_argument("--idle-s", type=float, default=2.0,
                        help="idle window that measures each process's background CPU")
    parser.add_argument("--litellm", action="store_true",
                        help="also measure LiteLLM proxy (installed into --litellm-venv)")
    parser.add_argument("--litellm-venv", default=".venv-litellm", type=Path,
                        help="the virtual environment LiteLLM is installed into")
    parser.add_argument("--rate-s", type=float, default=10.0,
                        help="seconds of the decisions-per-second run (0: skip it)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="closed-loop clients in the decisions-per-second run")
    parser.add_argument("--pin-epp-cpu", type=int, default=None, metavar="N",
                        help="run the ext_proc servers (floor, EPPs) on CPU N only and "
                             "everything else on the other CPUs (needs >= 2 CPUs)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.requests < 0 or args.warmup < 0 or args.max_tokens < 1 or not args.gap_ms >= 0:
        raise ValueError("--max-tokens must be >= 1, --requests/--warmup/--gap-ms >= 0")
    if args.rate_s < 0 or args.concurrency < 1:
        raise ValueError("--rate-s must be >= 0 and --concurrency >= 1")
    if args.requests == 0 and args.rate_s == 0:
        raise ValueError("--requests 0 and --rate-s 0 leave nothing to measure")
    out = Path(args.out) if args.out else None
    if out is not None and out.is_dir():
        raise ValueError(f"--out {out} is a folder: name the JSON file to write")
    pinning = cpu_pinning(args.pin_epp_cpu)
    exit_on_sigterm()
    results: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count()}
    if pinning is not None:
        results["pinning"] = {"epp_cpus": list(pinning.epp_cpus),
                              "other_cpus": list(pinning.other_cpus)}
    with on_other_cpus(pinning) as epp_cpus, \
            tempfile.TemporaryDirectory(prefix="kvguard-bench-gateway-") as work:
        config = Path(work) / "guard.toml"
        config.write_text(_CONFIG)
        if args.requests > 0:
            results["latency"] = _latency(args, Path(work), str(config), epp_cpus)
            _print_latency(results["latency"])
        if args.rate_s > 0:
            results["decisions"] = _decisions(args, Path(work), str(config), epp_cpus)
            print(json.dumps({"decisions": results["decisions"]}, indent=2), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    return 0


@dataclass(frozen=True)
class CpuPinning:
    """Which CPUs the ext_proc servers run on, and which everything else does."""

    epp_cpus: tuple[int, ...]
    other_cpus: tuple[int, ...]


def cpu_pinning(epp_cpu: int | None, available: set[int] | None = None,
                flag: str = "--pin-epp-cpu") -> CpuPinning | None:
    """``--pin-epp-cpu``: CPU ``epp_cpu`` for the ext_proc servers, the rest of ``available``
    (default: the CPUs this process may run on) for everything else; None without a CPU.
    Refuses (ValueError, naming ``flag``: another bench pins its own process the same way) a
    CPU not available, or fewer than 2 CPUs: the pinned process would share its CPU with the
    rest, which is the unpinned run."""
    if epp_cpu is None:
        return None
    cpus = set(os.sched_getaffinity(0) if available is None else available)
    if len(cpus) < 2:
        raise ValueError(f"{flag} needs at least 2 CPUs (one of its own and one for the "
                         f"rest); this process may run on {len(cpus)}: {sorted(cpus)}")
    if epp_cpu not in cpus:
        raise ValueError(f"{flag} {epp_cpu}: not a CPU this process may run on "
                         f"({sorted(cpus)})")
    return CpuPinning((epp_cpu,), tuple(sorted(cpus - {epp_cpu})))


@contextlib.contextmanager
def on_other_cpus(pinning: CpuPinning | None) -> Iterator[tuple[int, ...]]:
    """With a pinning: every thread of this process on its other CPUs while the block runs
    (children started in it inherit them), its own CPUs back after. Yields the pinned CPUs
    for the process the bench pins (empty without a pinning)."""
    if pinning is None:
        yield ()
        return
    own_cpus = os.sched_getaffinity(0)
    _set_process_affinity(pinning.other_cpus)
    try:
        yield pinning.epp_cpus
    finally:
        _set_process_affinity(own_cpus)


def _set_process_affinity(cpus: Iterable[int]) -> None:
    """Every thread of this process on ``cpus`` (a thread's affinity is its own; threads and
    children started later inherit their starter's)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def _proxy(upstream: str, config: str) -> ChildProcess:
    import sys

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "guard.cli", "proxy", "--upstream", upstream,
                "--config", config, "--host", "127.0.0.1", "--port", str(port)]
    return ChildProcess("proxy", argv, http_health,
                        ready_pattern=r"kvguard proxy listening on (\S+)")


def _floor(endpoint: str, cpus: Sequence[int] = ()) -> ChildProcess:
    import sys

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "chaos.bench.ext_proc_floor", "--endpoint", endpoint,
                "--port", str(port)]
    return ChildProcess("ext_proc floor", argv, accepts_connections, cpus=cpus,
                        ready_pattern=r"ext_proc floor listening on (grpc://\S+)")


@contextlib.contextmanager
def one_sim_replica() -> Iterator[tuple[str, int, list[ChildProcess]]]:
    """One sim replica of :data:`MODEL`: its URL, its pid, and a list for what the caller
    starts in front of it (Envoys, ext_proc servers, proxies), terminated last first when the
    block ends, before the replica."""
    spec = TopologySpec(num_replicas=1, replica_args=("--model", MODEL, "--backend", "sim"))
    children: list[ChildProcess] = []
    with Topology(spec) as fleet:
        try:
            yield fleet.replica_urls[0], fleet.replicas[0].pid, children
        finally:
            for child in reversed(children):
                child.terminate()


def _latency(args: argparse.Namespace, work: Path, config: str,
             epp_cpus: Sequence[int] = ()) -> dict:
    with one_sim_replica() as (upstream, replica_pid, children):
        endpoint = upstream.removeprefix("http://")
        urls, pids = {"direct": upstream}, {"direct": replica_pid}
        alone = envoy_child([], work, alone_upstreams=[endpoint])
        children.append(alone.start())
        urls["envoy alone"], pids["envoy alone"] = alone.url, alone.pid
        # the protocol's own cost: a do-nothing ext_proc server on grpc.aio, same modes
        floor = _floor(endpoint, epp_cpus)
        children.append(floor.start())
        floor_envoy = envoy_child([floor.port], work)
        children.append(floor_envoy.start())
        urls[FLOOR], pids[FLOOR] = floor_envoy.url, floor.pid
        epp = epp_child([upstream], config=config, cpus=epp_cpus)
        children.append(epp.start())
        envoy = envoy_child([epp.port], work)
        children.append(envoy.start())
        urls["envoy + kvguard epp"] = envoy.url
        # its CPU column is the EPP's (Envoy's own is about Envoy alone's)
        pids["envoy + kvguard epp"] = epp.pid
        # the response path off the first token: decision + observer filters, own EPP
        split_epp = epp_child([upstream], config=config, cpus=epp_cpus)
        children.append(split_epp.start())
        split_envoy = envoy_child([split_epp.port], work, split=True)
        children.append(split_envoy.start())
        urls[SPLIT], pids[SPLIT] = split_envoy.url, split_epp.pid
        proxy = _proxy(upstream, config)
        children.append(proxy.start())
        urls["kvguard proxy slo"], pids["kvguard proxy slo"] = proxy.url, proxy.pid
        if args.litellm:
            exe = ensure_venv(args.litellm_venv.resolve())
            child = litellm_child(exe, upstream, MODEL, free_port(), work, _KEY)
            children.append(child.start(timeout_s=180))
            urls["litellm"], pids["litellm"] = child.url, child.pid
        rows = _measure_all(urls, pids, args, baseline="envoy alone")
        for name, pid in pids.items():  # where the row's process ran (its CPU column's)
            rows[name]["cpus"] = sorted(os.sched_getaffinity(pid))
        # what each EPP's tickets saw: every measured stream completed (the split one's
        # through its observer), or the row's ticket view is not what the stream one has
        for name, child in (("envoy + kvguard epp", epp), (SPLIT, split_epp)):
            rows[name]["epp_completed"] = _completed(epp_metrics_url(child))
        alone_row = rows["envoy alone"]
        for row in rows.values():
            row["over_envoy_alone_ttft_p50_ms"] = row["ttft_p50_ms"] - alone_row["ttft_p50_ms"]
            row["over_envoy_alone_e2e_p50_ms"] = row["e2e_p50_ms"] - alone_row["e2e_p50_ms"]
        for name in (FLOOR, "envoy + kvguard epp", SPLIT):
            gap = rows[name]
            ttft_ms = gap["over_envoy_alone_ttft_p50_ms"]
            e2e_ms = gap["over_envoy_alone_e2e_p50_ms"]
            per_gap_ms = (e2e_ms - ttft_ms) / max(1, args.max_tokens - 1)
            gap["over_envoy_alone_per_token_gap_ms"] = per_gap_ms
            print(f"{name} over Envoy alone: TTFT p50 {ttft_ms:+.2f} ms, "
                  f"end-to-end p50 {e2e_ms:+.2f} ms ({per_gap_ms:+.3f} ms per token gap); "
                  f"paired by round: TTFT {gap['paired_ttft_p50_ms']:+.2f} ms, end-to-end "
                  f"{gap['paired_e2e_p50_ms']:+.2f} ms", flush=True)
        expected = args.warmup + args.requests
        for name in ("envoy + kvguard epp", SPLIT):
            print(f"{name}: {rows[name]['epp_completed']:.0f} of {expected} streams "
                  "completed in its EPP's tickets", flush=True)
        return rows


def _completed(metrics_url: str) -> float:
    """The EPP's completed requests, all classes and tenants (its ``/metrics``)."""
    text = httpx.get(metrics_url, timeout=10.0, trust_env=False).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("kvguard_requests_completed_total{"))


def _decisions(args: argparse.Namespace, work: Path, config: str,
               epp_cpus: Sequence[int] = ()) -> dict:
    spec = TopologySpec(num_replicas=1, replica_args=("--model", MODEL, "--backend", "sim",
                                                      "--time-scale", "0"))
    with Topology(spec) as fleet:
        epp = epp_child(fleet.replica_urls, config=config, cpus=epp_cpus).start()
        try:
            envoy = envoy_child([epp.port], work).start()
            try:
                before_s = _cpu_s(epp.pid)
                statuses = asyncio.run(_closed_loop(envoy.url, args.concurrency, args.rate_s))
                cpu_s = _cpu_s(epp.pid) - before_s
            finally:
                envoy.terminate()
        finally:
            epp.terminate()
    num_ok = statuses.get(200, 0)
    return {"concurrency": args.concurrency, "duration_s": args.rate_s,
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "decisions_per_s": num_ok / args.rate_s,
            "epp_cpu_ms_per_decision": 1000 * cpu_s / max(1, sum(statuses.values()))}


async def _closed_loop(url: str, concurrency: int, duration_s: float) -> dict[int, int]:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    statuses: dict[int, int] = {}
    deadline_s = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False,
                                 limits=limits) as client:
        async def worker() -> None:
            while time.monotonic() < deadline_s:
                response = await client.post("/v1/completions", content=body,
                                             headers={"content-type": "application/json"})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses
