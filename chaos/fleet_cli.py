"""``kvguard fleet``: N sim replicas and M proxies on loopback, until Ctrl-C or SIGTERM.

    kvguard fleet --replicas 4 --proxies 1
    kvguard fleet --replicas 2 --proxies 2 --redis --proxy-config guard.toml

Prints one line per process (``replica-0 http://127.0.0.1:PORT pid N``, ``proxy-0 ...``,
``redis redis://...``), then ``fleet ready``, and waits. SIGINT or SIGTERM stops every process
it started, by pid (:mod:`chaos.topology`).
"""

from __future__ import annotations

import argparse
import shlex
import signal

from chaos.replica import exit_on_sigterm
from chaos.topology import SIM_REPLICA_ARGS, Topology, TopologySpec

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="sim engine replicas (default 2)")
    parser.add_argument("--proxies", type=int, default=1, help="kvguard proxies (default 1)")
    parser.add_argument("--redis", action="store_true",
                        help="also start a redis-server (proxies get KVGUARD_REDIS_URL)")
    parser.add_argument("--replica-args", default=" ".join(SIM_REPLICA_ARGS),
                        help="arguments of every `kvguard engine` (default: %(default)r)")
    parser.add_argument("--proxy-config", default=None, metavar="FILE",
                        help="guard TOML every proxy reads (--config)")
    parser.add_argument("--start-timeout-s", type=float, default=90.0,
                        help="how long each replica and proxy may take to start")


def spec_from(args: argparse.Namespace) -> TopologySpec:
    proxy_args = ("--config", args.proxy_config) if args.proxy_config else ()
    return TopologySpec(num_replicas=args.replicas, replica_args=tuple(
        shlex.split(args.replica_args)), num_proxies=args.proxies, proxy_args=proxy_args,
        redis=args.redis, start_timeout_s=args.start_timeout_s)


def run(args: argparse.Namespace) -> int:
    spec = spec_from(args)
    exit_on_sigterm()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    with Topology(spec) as fleet:
        for child in [*fleet.replicas, *fleet.proxies]:
            print(f"{child.name} {child.url} pid {child.pid}", flush=True)
        if fleet.redis is not None:
            print(f"redis {fleet.redis_url} pid {fleet.redis.pid}", flush=True)
        print("fleet ready (Ctrl-C stops it)", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    print("fleet stopped", flush=True)
    return 0
