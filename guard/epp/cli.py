"""``kvguard epp``: the endpoint picker of Envoy (ext_proc) in front of one or more replicas.

    kvguard epp --upstream http://10.0.0.5:8000 --upstream http://10.0.0.6:8000 --port 9002
    kvguard epp --config guard.toml --redis redis://10.0.0.9:6379/0 --port 9002

Envoy's ``ext_proc`` filter streams each request to it (``FULL_DUPLEX_STREAMED``); it answers
with the replica to use as ``x-gateway-destination-endpoint: ip:port`` (Envoy's
``ORIGINAL_DST`` cluster connects there), or with the 429/503 the guard decided. The replica
URLs must name IP addresses. ``--upstream``, ``--state-source``, ``--config`` and ``--redis``
mean what they mean for ``kvguard proxy``; with ``--redis`` several EPPs share budgets and KV
reservations (active-active). Prints ``kvguard epp listening on grpc://HOST:PORT`` once it
serves. ``--metrics-port`` serves its Prometheus series over HTTP. SIGTERM/SIGINT drains (503 ``shutting_down``, admitted requests run on up to
``proxy.drain_timeout_s``), then exits 0; a second signal exits at once. ``--loop auto`` runs
it on uvloop when installed (grpc.aio hands every message between its own threads and the
loop; uvloop's wake-ups make that cheaper). ``--fallbacks N`` names up to N other routable
replicas after the pick (comma-separated), for an Envoy on ``deploy/envoy/override-host.yaml``.
The same EPP serves Envoy's split config (``deploy/envoy/envoy-split.yaml``: the response
reported by an observer filter off the first token's path); ``--observer-wait-s`` bounds how
long an admitted request waits there for its observer stream, and ``--epp-id`` names this EPP
for the routes that send observer streams back to it when several EPPs share one Envoy.

Needs the ``gateway`` extra (grpcio, grpcio-health-checking, protobuf, xds-protos).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from guard.config import config_with_upstreams
from serving.log_format import LOG_FORMATS, configure_logging

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", action="append", default=[], metavar="URL",
                        help="a replica's base URL, http://IP:PORT (repeatable); replaces "
                             "[[replicas]]")
    parser.add_argument("--replicas-from", default=None, metavar="SPEC",
                        help="where the replicas are listed, re-read while running: "
                             "file:PATH, dns:NAME:PORT or inferencepool:[NAMESPACE/]POOL (the "
                             "pool's Ready pods, watched through the Kubernetes API with the "
                             "pod's service account, as the reference EPP finds them), as "
                             "kvguard proxy's; replaces [proxy] replicas_from (default: none, "
                             "the replicas are fixed)")
    parser.add_argument("--state-source", choices=("kvguard", "stream", "vllm", "none"),
                        default="kvguard",
                        help="how --upstream replicas publish load (default: kvguard)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="guard TOML (default: $KVGUARD_CONFIG, else built-in defaults)")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis shared with every other EPP and proxy (budgets, KV "
                             "reservations); replaces redis_url")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on")
    parser.add_argument("--port", type=int, default=9002, help="gRPC port; 0 picks a free one")
    parser.add_argument("--fallbacks", type=int, default=0, metavar="N",
                        help="name up to N other routable replicas after the chosen one in "
                             "x-gateway-destination-endpoint (comma-separated), for an Envoy "
                             "whose replicas cluster uses override-host load balancing with "
                             "retries; Envoy's ORIGINAL_DST cluster takes one endpoint only "
                             "(default: 0)")
    parser.add_argument("--observer-wait-s", type=float, default=5.0, metavar="S",
                        help="with Envoy's split config (deploy/envoy/envoy-split.yaml): how "
                             "long an admitted request waits for its observer stream before "
                             "its ticket is released unobserved (default: 5.0)")
    parser.add_argument("--epp-id", default=None, metavar="ID",
                        help="with the split config and several EPPs behind one Envoy: this "
                             "EPP's name, which Envoy's per-EPP routes match to send a "
                             "request's observer stream back to the EPP that decided it "
                             "(default: none, one EPP)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve GET /metrics (Prometheus) over HTTP on this port of --host "
                             "(0 picks a free one; default: no metrics endpoint)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop (default: auto, uvloop when installed)")
    parser.add_argument("--log-level", default="warning",
                        help="debug, info (lifecycle events), warning or error "
                             "(default: warning)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="log lines as text or one JSON object each, with a UTC timestamp "
                             "(default: text)")
    parser.add_argument("--access-log", action="store_true",
                        help="one kvguard.access line per request: id, tenant, model, replica, "
                             "decision, status, TTFT, tokens, duration (default: off)")


def run(args: argparse.Namespace) -> int:
    if args.fallbacks < 0:
        raise ValueError(f"--fallbacks must be >= 0, got {args.fallbacks}")
    if not args.observer_wait_s > 0:
        raise ValueError(f"--observer-wait-s must be > 0, got {args.observer_wait_s}")
    configure_logging(args.log_level, args.log_format)
    from serving.h1server import event_loop_runner

    return event_loop_runner(args.loop)(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from guard.epp.server import EppServer

    server = EppServer(config_with_upstreams(args.config, args.upstream,
                                             args.state_source, args.redis,
                                             args.replicas_from),
                       state_source=args.state_source, access_log=args.access_log,
                       num_fallbacks=args.fallbacks, observer_wait_s=args.observer_wait_s,
                       epp_id=args.epp_id)
    port = await server.start(args.host, args.port)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.drain)
    host = f"[{args.host}]" if ":" in args.host else args.host
    line = f"kvguard epp listening on grpc://{host}:{port}"
    if args.metrics_port is not None:
        metrics_port = await server.serve_metrics(args.host, args.metrics_port)
        line += f" (metrics http://{host}:{metrics_port}/metrics)"
    print(line, flush=True)
    await server.wait_stopped()
    return 0
