"""``kvguard proxy``: the standalone proxy in front of one or more replicas.

    kvguard proxy --upstream http://127.0.0.1:8001 --upstream http://127.0.0.1:8002
    kvguard proxy --config guard.toml --port 9000        # replicas from [[replicas]]
    kvguard proxy --upstream http://vllm:8000 --state-source vllm
    kvguard proxy --config guard.toml --redis redis://127.0.0.1:6379/0   # budgets shared by proxies

``--upstream`` (repeatable) replaces the config's ``[[replicas]]`` (ids ``r0``, ``r1``, … in
order, state read as ``--state-source``, by default ``auto``: ``/kvguard/state``, else the
vLLM, SGLang, TGI or llama.cpp ``/metrics`` page, else each replica's concurrency limit is
learned from its responses). ``--redis URL`` replaces the config's ``redis_url``: tenant
budgets are then shared with every other guard or proxy on that Redis. Prints ``kvguard proxy listening on http://HOST:PORT``
once it accepts connections (``--port 0``: the port the OS chose). SIGTERM/SIGINT drains: new
requests get 503 ``shutting_down``, admitted ones run until they end or ``proxy.drain_timeout_s``
passes (one deadline: a stream still running then ends with an SSE error event
``shutting_down``), then the process exits 0; a second signal exits at once.

Slow or greedy clients are bounded as in ``kvguard engine`` (``serving.ServerLimits``:
``--header-timeout-s``, ``--body-timeout-s``, ``--keep-alive-timeout-s``, ``--write-timeout-s``,
``--max-connections``, ``--max-connections-per-client``), on every ``--http`` server: ``kvguard``
(the default), kvguard's own HTTP/1.1 server on asyncio protocols (``serving.h1server``), which
adds less latency, or uvicorn (``h11``, ``httptools``; ``auto`` picks httptools when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from guard.config import config_with_upstreams
from serving import add_limit_arguments, install_quiet_logging, limits_from_args
from serving.log_format import LOG_FORMATS, configure_logging

__all__ = ["CUT_GRACE_S", "configure", "run"]

# after the drain deadline: how long the cut responses' last events have to reach their clients
CUT_GRACE_S = 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", action="append", default=[], metavar="URL",
                        help="a replica's base URL (repeatable); replaces [[replicas]]")
    parser.add_argument("--state-source",
                        choices=("auto", "kvguard", "stream", "vllm", "sglang", "tgi", "llamacpp",
                                 "none"),
                        default="auto",
                        help="how --upstream replicas publish load (default: auto: probe "
                             "/kvguard/state (streamed when the replica offers /kvguard/state/stream), then the vLLM, SGLang, TGI and llama.cpp /metrics "
                             "formats, else learn each replica's concurrency limit; stream: a kvguard "
                             "replica's /kvguard/state/stream, one response of deltas)")
    parser.add_argument("--replicas-from", default=None, metavar="SPEC",
                        help="where the replicas are listed, re-read while running: "
                             "file:PATH (TOML [[replicas]] or a JSON list, as a mounted "
                             "ConfigMap), dns:NAME:PORT (a headless Service) or "
                             "inferencepool:[NAMESPACE/]POOL (the Ready pods of a Gateway API "
                             "InferencePool, watched through the Kubernetes API with the pod's "
                             "service account); replaces [proxy] replicas_from (default: none, "
                             "the replicas are fixed)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="guard TOML (default: $KVGUARD_CONFIG, else built-in defaults)")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis holding the tenant budgets shared by every proxy "
                             "(replaces redis_url; budgets themselves come from the config)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=9000, help="0 picks a free port")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop (auto: uvloop when installed)")
    parser.add_argument("--http", choices=("kvguard", "auto", "h11", "httptools"),
                        default="kvguard",
                        help="HTTP server: kvguard's own HTTP/1.1 server (serving.h1server; "
                             "the default), or uvicorn with its h11 or httptools parser "
                             "(auto: httptools when installed)")
    parser.add_argument("--log-level", default="warning",
                        help="debug, info (lifecycle events: re-admissions, drain, Redis "
                             "switches), warning or error")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="log lines as text or one JSON object each, with a UTC timestamp")
    parser.add_argument("--access-log", action="store_true",
                        help="one kvguard.access line per request: id, tenant, model, replica, "
                             "decision, status, TTFT, tokens, duration")
    add_limit_arguments(parser)




async def _drain(app) -> None:
    """Stop admitting; let in-flight requests run until ``drain_timeout_s`` (the drain's one
    deadline), then cut those left (a stream ends with an SSE error event ``shutting_down``,
    see ``Forwarder.cut_all``) and give their last bytes ``CUT_GRACE_S`` to go out. The
    server's own graceful wait that follows is only that grace, not a second timeout."""
    app.drain()
    await _until_idle(app, time.monotonic() + app.config.proxy.drain_timeout_s)
    if app.num_in_flight:
        app.forwarder.cut_all()
        await _until_idle(app, time.monotonic() + CUT_GRACE_S)


async def _until_idle(app, deadline_s: float) -> None:
    while app.num_in_flight and time.monotonic() < deadline_s:
        await asyncio.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    from guard.proxy.app import ProxyApp
    from serving.draining_server import draining_server, listening_socket
    from serving.limited_protocol import ConnectionTable, uvicorn_config

    configure_logging(args.log_level, args.log_format)
    table = ConnectionTable(limits_from_args(args))
    app = ProxyApp(config_with_upstreams(args.config, args.upstream,
                                         args.state_source, args.redis,
                                         args.replicas_from),
                   access_log=args.access_log, state_source=args.state_source)
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    ready_line = f"kvguard proxy listening on {url}"
    graceful_timeout_s = CUT_GRACE_S  # _drain has waited drain_timeout_s already
    if args.http == "kvguard":
        return _run_h1server(app, table, sock, args, ready_line, graceful_timeout_s)
    config = uvicorn_config(app, table, http=args.http, log_level=args.log_level,
                            access_log=False, lifespan="on", loop=args.loop,
                            timeout_graceful_shutdown=graceful_timeout_s)
    install_quiet_logging()
    server = draining_server(config, lambda: _drain(app), ready_line)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


def _run_h1server(app, table, sock, args: argparse.Namespace, ready_line: str,
                  graceful_timeout_s: float) -> int:
    """``--http kvguard``: the same app, limits, drain and ready line on serving.h1server."""
    from serving.h1server import H1Server
    from serving.h1server import run as serve

    install_quiet_logging()
    server = H1Server(app, table, graceful_timeout_s=graceful_timeout_s)
    try:
        started = serve(server, [sock], drain=lambda: _drain(app), ready_line=ready_line,
                        loop=args.loop)
    finally:
        sock.close()
    return 0 if started else 1
