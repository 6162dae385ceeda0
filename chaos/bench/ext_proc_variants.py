"""``python -m chaos.bench.ext_proc_variants``: ways to serve ext_proc from Python, side by side.

What the first token costs behind Envoy for variants of the do-nothing ext_proc server
(:mod:`chaos.bench.ext_proc_floor`) and of ``kvguard epp``, each with an Envoy of its own, next
to Envoy alone, in one process tree: the same sim replica, sequential streamed completions, the
targets interleaved round by round as ``kvguard bench gateway`` measures them (its code), and
for each the median over rounds of its TTFT (end-to-end) minus Envoy alone's in the same round.

Variants (``--variants``, comma-separated names of :data:`VARIANTS`): the server (grpc.aio on
uvloop or asyncio, grpc's thread-pool server, or ``kvguard epp``), how Envoy reaches it (its
own gRPC client ``envoy_grpc`` or the Google C++ one ``google_grpc``; TCP or a Unix socket),
gRPC's environment knobs and server channel arguments. ``--pin-epp-cpu N`` runs every ext_proc
server on CPU N and everything else on the other CPUs (as ``kvguard bench gateway``).
``--envoy-stages`` also logs Envoy's own timestamps of each request (:data:`STAGES`: when the
request began and ended arriving, when Envoy began sending it upstream, when the replica's
answer began, when Envoy began answering) and prints their medians: where, between Envoy and
the ext_proc server, the time goes.

    python -m chaos.bench.ext_proc_variants --variants aio,sync,aio-google --requests 200
    python -m chaos.bench.ext_proc_variants --variants aio-decision,node-decision \
        --node-modules /tmp/node_modules --pin-epp-cpu 1 --envoy-stages
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chaos.bench.gateway import cpu_pinning, on_other_cpus, one_sim_replica
from chaos.bench.proxy import _measure_all
from chaos.child import ChildProcess
from chaos.envoy_front import (
    EXT_PROC_FILTER,
    accepts_connections,
    envoy_alone_config,
    envoy_binary,
    envoy_config,
    epp_child,
)
from chaos.ports import free_port
from chaos.replica import exit_on_sigterm
from chaos.topology import http_health

__all__ = ["NODE_FLOOR", "VARIANTS", "Variant", "main"]

NODE_FLOOR = Path(__file__).with_name("ext_proc_floor_node.js")


@dataclass(frozen=True)
class Variant:
    """One way to serve ext_proc: ``server`` ``aio`` / ``sync`` (the floor), ``node`` (the
    floor in Node.js, :data:`NODE_FLOOR`) or ``epp``."""

    server: str = "aio"
    google_grpc: bool = False       # Envoy's ext_proc client: google_grpc, not envoy_grpc
    unix: bool = False              # a Unix socket between Envoy and the server
    env: tuple[tuple[str, str], ...] = ()
    grpc_args: tuple[str, ...] = ()  # the floor's --grpc-arg KEY=VALUE
    loop: str = "auto"
    # the decision alone: the response neither sent to the server nor waited for (the split
    # config's decision filter without its observer), so one round trip before the first token
    decision_only: bool = False


_IOMGR = "-event_engine_listener,-event_engine_for_all_other_endpoints"

VARIANTS = {
    "aio": Variant(),
    "aio-asyncio": Variant(loop="asyncio"),
    "sync": Variant(server="sync"),
    "aio-google": Variant(google_grpc=True),
    "sync-google": Variant(server="sync", google_grpc=True),
    "aio-unix": Variant(unix=True),
    "aio-google-unix": Variant(google_grpc=True, unix=True),
    "aio-poll": Variant(env=(("GRPC_POLL_STRATEGY", "poll"),)),
    "aio-fork": Variant(env=(("GRPC_ENABLE_FORK_SUPPORT", "1"),)),
    # HTTP/2 knobs: no BDP probing (its pings), a large first window, streams unbounded
    "aio-h2": Variant(grpc_args=("grpc.http2.bdp_probe=0",
                                 "grpc.http2.lookahead_bytes=1048576",
                                 "grpc.max_concurrent_streams=1000")),
    "aio-latency": Variant(grpc_args=("grpc.optimization_target=latency",)),
    # grpc core's older I/O path: the sockets polled by the thread that polls the completion
    # queue (grpc.aio's poller thread) instead of handed over from EventEngine's threads
    "aio-iomgr": Variant(env=(("GRPC_EXPERIMENTS", _IOMGR),)),
    "sync-iomgr": Variant(server="sync", env=(("GRPC_EXPERIMENTS", _IOMGR),)),
    "aio-decision": Variant(decision_only=True),
    "aio-iomgr-decision": Variant(decision_only=True, env=(("GRPC_EXPERIMENTS", _IOMGR),)),
    "sync-decision": Variant(server="sync", decision_only=True),
    # outside Python: Node.js and @grpc/grpc-js (--node-modules), one thread
    "node": Variant(server="node"),
    "node-decision": Variant(server="node", decision_only=True),
    "epp": Variant(server="epp"),
    "epp-iomgr": Variant(server="epp", env=(("GRPC_EXPERIMENTS", _IOMGR),)),
    "epp-google": Variant(server="epp", google_grpc=True),
    "epp-poll": Variant(server="epp", env=(("GRPC_POLL_STRATEGY", "poll"),)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.bench.ext_proc_variants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="aio,sync,aio-google,epp",
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--requests", type=int, default=200, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured rounds")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per completion")
    parser.add_argument("--gap-ms", type=float, default=3.0, help="pause before each request")
    parser.add_argument("--idle-s", type=float, default=2.0,
                        help="idle window that measures each process's background CPU")
    parser.add_argument("--pin-epp-cpu", type=int, default=None, metavar="N",
                        help="the ext_proc servers on CPU N, everything else on the others")
    parser.add_argument("--node-modules", default=None, type=Path,
                        help="a node_modules folder with @grpc/grpc-js (the node variants)")
    parser.add_argument("--envoy-stages", action="store_true",
                        help="also each Envoy's own timestamps per request (access log), "
                             "medians")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    names = [name for name in args.variants.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names or args.requests < 1:
        parser.error(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)}); "
                     "--requests must be >= 1")
    if args.node_modules is None and any(VARIANTS[name].server == "node" for name in names):
        parser.error("the node variants need --node-modules (npm install @grpc/grpc-js)")
    pinning = cpu_pinning(args.pin_epp_cpu)
    exit_on_sigterm()
    with on_other_cpus(pinning) as epp_cpus, \
            tempfile.TemporaryDirectory(prefix="kvguard-ext-proc-variants-") as work:
        rows = _run(args, names, Path(work), epp_cpus, args.node_modules)
    print(f"{'variant':<18} {'TTFT p50':>9} {'paired TTFT':>12} {'paired e2e':>11} "
          f"{'CPU ms/req':>11}  (ms; paired: over Envoy alone, median over rounds)")
    for name, row in rows.items():
        print(f"{name:<18} {row['ttft_p50_ms']:9.2f} {row['paired_ttft_p50_ms']:+12.2f} "
              f"{row['paired_e2e_p50_ms']:+11.2f} {row['cpu_ms_per_request']:11.2f}")
    if args.envoy_stages:
        print(f"Envoy's timestamps, median ms: {'variant':<18} " + " ".join(
            f"{stage:>20}" for stage in STAGES))
        for name, row in rows.items():
            if "envoy_stages_ms" in row:
                print(f"{'':<30} {name:<18} " + " ".join(
                    f"{'-' if v is None else f'{v:.2f}':>20}"
                    for v in row["envoy_stages_ms"].values()))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def _run(args: argparse.Namespace, names: Sequence[str], work: Path,
         epp_cpus: Sequence[int], node_modules: Path | None = None) -> dict:
    config = work / "guard.toml"
    config.write_text('policy = "slo"\n')
    with one_sim_replica() as (upstream, replica_pid, children):
        endpoint = upstream.removeprefix("http://")
        urls, pids = {"direct": upstream}, {"direct": replica_pid}
        logs = {}  # each Envoy's access log of its own timestamps (--envoy-stages)
        listener_port, admin_port = free_port(), free_port()
        path = envoy_alone_config(work, listener_port=listener_port, admin_port=admin_port,
                                  upstreams=[endpoint])
        if args.envoy_stages:
            logs["envoy alone"] = _with_stage_log(path, work / "envoy-alone.log")
        alone = _envoy_child(path, listener_port)
        children.append(alone.start())
        urls["envoy alone"], pids["envoy alone"] = alone.url, alone.pid
        for name in names:
            variant = VARIANTS[name]
            socket_path = work / f"{name}.sock" if variant.unix else None
            server = _server(variant, endpoint, upstream, str(config), socket_path,
                             epp_cpus, node_modules)
            children.append(server.start())
            path, listener_port = _envoy_config(variant, work, server.port, socket_path)
            if args.envoy_stages:
                logs[name] = _with_stage_log(path, work / f"envoy-{name}.log")
            envoy = _envoy_child(path, listener_port)
            children.append(envoy.start())
            urls[name], pids[name] = envoy.url, server.pid
        rows = _measure_all(urls, pids, args, baseline="envoy alone")
        for name, log in logs.items():
            rows[name]["envoy_stages_ms"] = _stage_medians(log, args.requests)
        return rows


def _server(variant: Variant, endpoint: str, upstream: str, config: str,
            socket_path: Path | None, cpus: Sequence[int],
            node_modules: Path | None = None) -> ChildProcess:
    env = dict(variant.env)
    if variant.server == "node":
        return _node_floor(endpoint, cpus, node_modules)
    if variant.server == "epp":
        if variant.unix or variant.grpc_args:
            raise ValueError("the epp variants take no Unix socket or gRPC arguments")
        return epp_child([upstream], config=config, cpus=cpus, env=env,
                         extra_args=("--loop", variant.loop))
    args = ["--endpoint", endpoint, "--server", variant.server, "--loop", variant.loop]
    for grpc_arg in variant.grpc_args:
        args += ["--grpc-arg", grpc_arg]
    if socket_path is not None:
        path = str(socket_path)
        return ChildProcess(
            "ext_proc floor", lambda _port: [sys.executable, "-m", "chaos.bench.ext_proc_floor",
                                             *args, "--listen", f"unix:{path}"],
            lambda _url: _unix_accepts(path), port=1, env=env, cpus=cpus)
    return ChildProcess(
        "ext_proc floor", lambda port: [sys.executable, "-m", "chaos.bench.ext_proc_floor",
                                        *args, "--port", str(port)],
        accepts_connections, env=env, cpus=cpus,
        ready_pattern=r"ext_proc floor listening on (grpc://\S+)")


def _node_floor(endpoint: str, cpus: Sequence[int], node_modules: Path | None) -> ChildProcess:
    """The floor in Node.js, given the answers that do not depend on the request (built here
    with :mod:`guard.epp.messages`, so both floors send the same bytes)."""
    import shutil

    from guard.epp import messages
    from guard.epp.picker import Route

    node = shutil.which("node")
    if node is None or node_modules is None:
        raise ValueError("the node variants need node and --node-modules")
    answers = [messages.request_headers_answer(Route(endpoint, "r0", b"")),
               messages.response_headers_answer(()), messages.trailers_answer(False),
               messages.trailers_answer(True)]
    hexes = [answer.SerializeToString().hex() for answer in answers]
    return ChildProcess(
        "ext_proc floor (node)", lambda port: [node, str(NODE_FLOOR), str(port), *hexes],
        accepts_connections, env={"NODE_PATH": str(node_modules.resolve())}, cpus=cpus,
        ready_pattern=r"ext_proc floor listening on (grpc://\S+)")


def _unix_accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(path)
            return True
        except OSError:
            return False


def _envoy_config(variant: Variant, work: Path, port: int,
                  socket_path: Path | None) -> tuple[Path, int]:
    """``deploy/envoy/envoy.yaml`` in front of the server, its ext_proc filter's gRPC client,
    processing modes and the server's address as the variant says; (its path, its listener
    port)."""
    listener_port, admin_port = free_port(), free_port()
    path = envoy_config(work, listener_port=listener_port, admin_port=admin_port,
                        epp_ports=[port])
    config = json.loads(path.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == EXT_PROC_FILTER)
    if variant.decision_only:
        ext_proc["typed_config"]["processing_mode"].update(
            response_header_mode="SKIP", response_body_mode="NONE", response_trailer_mode="SKIP")
    if variant.google_grpc:
        target = f"unix:{socket_path}" if socket_path is not None else f"127.0.0.1:{port}"
        ext_proc["typed_config"]["grpc_service"] = {
            "google_grpc": {"target_uri": target, "stat_prefix": "kvguard_epp"},
            "timeout": "30s"}
    elif socket_path is not None:
        cluster = next(c for c in config["static_resources"]["clusters"]
                       if c["name"] == "kvguard_epp")
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"pipe": {"path": str(socket_path)}}}}]
    path.write_text(json.dumps(config, indent=1))
    return path, listener_port


def _envoy_child(path: Path, listener_port: int) -> ChildProcess:
    binary = envoy_binary()

    def argv(_port: int) -> list[str]:
        return [binary, "-c", str(path), "--disable-hot-restart", "--log-level", "error",
                "--concurrency", "1"]

    return ChildProcess("envoy", argv, http_health, port=listener_port)


# Envoy's own timestamps of each request (its access log's COMMON_DURATION, in µs):
# downstream request begin/end (DS_RX_BEG/END), upstream request sent (US_TX_BEG), upstream
# response begun (US_RX_BEG), downstream response begun (DS_TX_BEG)
STAGES = ("DS_RX_BEG:DS_RX_END", "DS_RX_BEG:US_TX_BEG", "DS_RX_END:US_TX_BEG",
          "US_TX_BEG:US_RX_BEG", "US_RX_BEG:DS_TX_BEG")


def _with_stage_log(path: Path, log: Path) -> Path:
    """The Envoy config at ``path`` with an access log of :data:`STAGES` (JSON lines) to
    ``log``; ``log``."""
    config = json.loads(path.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    line = json.dumps({stage: f"%COMMON_DURATION({stage}:us)%" for stage in STAGES}) + "\n"
    manager["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(log), "log_format": {"text_format_source": {"inline_string": line}}}}]
    path.write_text(json.dumps(config, indent=1))
    return log


def _stage_medians(log: Path, last: int) -> dict[str, float | None]:
    """Each stage's median over the last ``last`` requests Envoy logged, ms (None where Envoy
    logged none: a stage that ends before it begins, e.g. US_TX_BEG before DS_RX_END)."""
    import statistics
    import time

    for _ in range(50):  # Envoy flushes its access log every second
        lines = [json.loads(text) for text in log.read_text().splitlines()
                 if text.startswith("{")] if log.exists() else []
        if len(lines) >= last:
            break
        time.sleep(0.1)
    lines = lines[-last:]
    medians: dict[str, float | None] = {}
    for stage in STAGES:
        values = [float(line[stage]) for line in lines if line[stage] not in ("-", "")]
        medians[stage] = statistics.median(values) / 1000 if values else None
    return medians


if __name__ == "__main__":
    raise SystemExit(main())
