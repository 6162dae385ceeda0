"""A real Envoy as the clients' entry balancer in front of M ``kvguard proxy`` processes.

The ``proxy-kill-envoy`` scenario's front (``ScenarioSpec.entry = "envoy"``): clients connect
to one Envoy, which spreads requests round-robin over the proxies and takes a killed one out,
as an operator running kvguard proxies behind Envoy would configure it:

* active HTTP health checks on each proxy's ``GET /health`` (200 while a replica is
  routable), every 0.5 s, also before the cluster's first request (``no_traffic_interval``):
  a proxy that stops answering is out after two misses and back after one answer;
* outlier detection on local-origin failures only (``split_external_local_origin_errors``):
  a refused or reset connection ejects the proxy at once. A 503 from a proxy is kvguard
  shedding, not a sick proxy, so the 5xx and gateway-failure ejections (on by default) are
  off: with them Envoy would eject the proxies for doing their job under overload;
* route retries on ``connect-failure,refused-stream,reset`` to the other proxy
  (``previous_hosts``): nothing reached a proxy that refused, and a reset before the response
  headers is one Envoy may re-send. Never on 5xx: a shed is an answer, not a failure.
  A stream already flowing when its proxy dies is cut (Envoy has sent it on by then), and
  closed to the client at once (``delayed_close_timeout`` 0: Envoy's default waits 1 s).

The admission decisions stay the proxies': Envoy's thresholds are set out of the way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from chaos.child import ChildProcess
from chaos.envoy_front import cluster_stats, envoy_binary
from chaos.ports import free_port
from chaos.topology import http_health

__all__ = ["ENTRY_STATS", "entry_child", "entry_config", "entry_stats"]

HEALTH_INTERVAL_S = 0.5
# the counters of the proxies cluster a run's verdict keeps (the whole list is in the file)
ENTRY_STATS: tuple[str, ...] = (
    "health_check.failure", "health_check.network_failure", "outlier_detection.ejections_enforced_total",
    "upstream_cx_connect_fail", "upstream_rq_retry", "upstream_rq_retry_success",
    "upstream_cx_destroy_remote_with_active_rq")
_OPEN = {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000,
         "max_retries": 40000}


def _endpoint(url: str) -> dict:
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"proxy URL: need http://host:port, got {url!r}")
    return {"endpoint": {"address": {"socket_address": {"address": host.strip("[]"),
                                                        "port_value": int(port)}}}}


def _cluster(proxy_urls: Sequence[str]) -> dict:
    return {
        "name": "proxies", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "1s",
        "circuit_breakers": {"thresholds": [dict(_OPEN)]},
        "health_checks": [{
            "timeout": "1s", "interval": f"{HEALTH_INTERVAL_S}s",
            # Envoy checks a cluster that has had no traffic yet every 60 s by default, and
            # the first check comes before any: without this, the second comes a minute on
            "no_traffic_interval": f"{HEALTH_INTERVAL_S}s",
            "unhealthy_threshold": 2, "healthy_threshold": 1,
            "http_health_check": {"path": "/health"}}],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0, "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0, "enforcing_local_origin_success_rate": 0,
            "interval": "1s", "base_ejection_time": "2s", "max_ejection_percent": 50,
            "successful_active_health_check_uneject_host": True},
        "load_assignment": {"cluster_name": "proxies",
                            "endpoints": [{"lb_endpoints": [_endpoint(u) for u in proxy_urls]}]},
    }


def entry_config(directory: Path, *, listener_port: int, admin_port: int,
                 proxy_urls: Sequence[str]) -> Path:
    """The Envoy config (JSON, which Envoy reads as YAML) written into ``directory``."""
    if not proxy_urls:
        raise ValueError("proxy_urls: the entry Envoy needs at least one kvguard proxy")
    route = {"cluster": "proxies", "timeout": "0s",
             "retry_policy": {
                 "retry_on": "connect-failure,refused-stream,reset", "num_retries": 2,
                 "retry_host_predicate": [{
                     "name": "envoy.retry_host_predicates.previous_hosts",
                     "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry."
                                               "host.previous_hosts.v3.PreviousHostsPredicate"}}],
                 "host_selection_retry_max_attempts": 3}}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "entry", "codec_type": "AUTO", "stream_idle_timeout": "300s",
        # a stream cut by its proxy's death is closed to the client at once: by default Envoy
        # waits 1 s for the client to close first, so the client learned of the cut 1 s late
        "delayed_close_timeout": "0s",
        "route_config": {"name": "entry", "virtual_hosts": [{
            "name": "proxies", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "clients", "address": {"socket_address": {
                "address": "127.0.0.1", "port_value": listener_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": manager}]}]}],
            "clusters": [_cluster(proxy_urls)]},
    }
    path = directory / f"envoy-entry-{listener_port}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def entry_child(proxy_urls: Sequence[str], directory: Path, admin_port: int, *,
                niceness: int = 0) -> ChildProcess:
    """Envoy on a free loopback port in front of ``proxy_urls``, its admin page on
    ``admin_port`` (``/stats``: the health checks and ejections); healthy once a
    ``GET /health`` through it (a proxy, then a replica) answers 200."""
    listener_port = free_port()
    path = entry_config(directory, listener_port=listener_port, admin_port=admin_port,
                        proxy_urls=proxy_urls)
    binary = envoy_binary()

    def argv(_port: int) -> list[str]:
        return [binary, "-c", str(path), "--disable-hot-restart", "--log-level", "error",
                "--concurrency", "1"]

    return ChildProcess("envoy-entry", argv, http_health, port=listener_port, niceness=niceness)


def entry_stats(admin_url: str, path: Path) -> dict:
    """The entry Envoy's ``cluster.proxies.*`` stats: all of them written to ``path``,
    :data:`ENTRY_STATS` returned (``{"error": ...}`` when the admin page did not answer)."""
    return cluster_stats(admin_url, "proxies", ENTRY_STATS, path)
