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

    python -m chaos.bench.ext_proc_variants --variants aio,sync,aio-google --requests 200
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

from chaos.bench.gateway import MODEL, _set_process_affinity, cpu_pinning
from chaos.bench.proxy import _measure_all
from chaos.child import ChildProcess
from chaos.envoy_front import (
    EXT_PROC_FILTER,
    accepts_connections,
    envoy_binary,
    envoy_child,
    envoy_config,
    epp_child,
)
from chaos.ports import free_port
from chaos.replica import exit_on_sigterm
from chaos.topology import Topology, TopologySpec, http_health

__all__ = ["VARIANTS", "Variant", "main"]


@dataclass(frozen=True)
class Variant:
    """One way to serve ext_proc: ``server`` ``aio`` / ``sync`` (the floor) or ``epp``."""

    server: str = "aio"
    google_grpc: bool = False       # Envoy's ext_proc client: google_grpc, not envoy_grpc
    unix: bool = False              # a Unix socket between Envoy and the server
    env: tuple[tuple[str, str], ...] = ()
    grpc_args: tuple[str, ...] = ()  # the floor's --grpc-arg KEY=VALUE
    loop: str = "auto"


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
    "epp": Variant(server="epp"),
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
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    names = [name for name in args.variants.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names or args.requests < 1:
        parser.error(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)}); "
                     "--requests must be >= 1")
    pinning = cpu_pinning(args.pin_epp_cpu)
    exit_on_sigterm()
    if pinning is not None:
        _set_process_affinity(pinning.other_cpus)
    epp_cpus = pinning.epp_cpus if pinning is not None else ()
    with tempfile.TemporaryDirectory(prefix="kvguard-ext-proc-variants-") as work:
        rows = _run(args, names, Path(work), epp_cpus)
    print(f"{'variant':<18} {'TTFT p50':>9} {'paired TTFT':>12} {'paired e2e':>11} "
          f"{'CPU ms/req':>11}  (ms; paired: over Envoy alone, median over rounds)")
    for name, row in rows.items():
        print(f"{name:<18} {row['ttft_p50_ms']:9.2f} {row['paired_ttft_p50_ms']:+12.2f} "
              f"{row['paired_e2e_p50_ms']:+11.2f} {row['cpu_ms_per_request']:11.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def _run(args: argparse.Namespace, names: Sequence[str], work: Path,
         epp_cpus: Sequence[int]) -> dict:
    config = work / "guard.toml"
    config.write_text('policy = "slo"\n')
    spec = TopologySpec(num_replicas=1, replica_args=("--model", MODEL, "--backend", "sim"))
    children: list[ChildProcess] = []
    try:
        with Topology(spec) as fleet:
            upstream = fleet.replica_urls[0]
            endpoint = upstream.removeprefix("http://")
            urls, pids = {"direct": upstream}, {"direct": fleet.replicas[0].pid}
            alone = envoy_child([], work, alone_upstreams=[endpoint])
            children.append(alone.start())
            urls["envoy alone"], pids["envoy alone"] = alone.url, alone.pid
            for name in names:
                variant = VARIANTS[name]
                socket_path = work / f"{name}.sock" if variant.unix else None
                server = _server(variant, endpoint, upstream, str(config), socket_path,
                                 epp_cpus)
                children.append(server.start())
                envoy = _envoy(variant, work, server.port, socket_path)
                children.append(envoy.start())
                urls[name], pids[name] = envoy.url, server.pid
            return _measure_all(urls, pids, args, baseline="envoy alone")
    finally:
        for child in reversed(children):
            child.terminate()


def _server(variant: Variant, endpoint: str, upstream: str, config: str,
            socket_path: Path | None, cpus: Sequence[int]) -> ChildProcess:
    env = dict(variant.env)
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


def _unix_accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(path)
            return True
        except OSError:
            return False


def _envoy(variant: Variant, work: Path, port: int, socket_path: Path | None) -> ChildProcess:
    """Envoy on ``deploy/envoy/envoy.yaml`` in front of the server: its ext_proc filter's gRPC
    client and the server's address as the variant says."""
    listener_port, admin_port = free_port(), free_port()
    path = envoy_config(work, listener_port=listener_port, admin_port=admin_port,
                        epp_ports=[port])
    config = json.loads(path.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == EXT_PROC_FILTER)
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
    binary = envoy_binary()

    def argv(_port: int) -> list[str]:
        return [binary, "-c", str(path), "--disable-hot-restart", "--log-level", "error",
                "--concurrency", "1"]

    return ChildProcess("envoy", argv, http_health, port=listener_port)


if __name__ == "__main__":
    raise SystemExit(main())
