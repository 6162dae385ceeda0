"""The proxy's own Prometheus series, on the guard's registry (served at ``/kvguard/metrics``).

* ``kvguard_proxy_redispatches_total{replica}``: requests moved off ``replica`` before any
  the request reached it (connect error, a pooled connection found closed, the replica's 503).
* ``kvguard_proxy_upstream_failures_total{replica,kind}``: ``kind`` is ``unreachable``,
  ``timeout``, ``status`` (a 5xx answer), ``unavailable`` (a 503, not counted toward
  ejection), ``broken`` (closed after the request was written, or a response cut mid-way) or
  ``malformed`` (not valid HTTP/1.1; not counted toward ejection).
* ``kvguard_proxy_ejections_total{replica}`` and ``kvguard_proxy_replica_routable{replica}``
  (1 while the policy may pick it).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, replica_ids: list[str],
                 routable: Callable[[str], bool], num_ejections: Callable[[str], int]) -> None:
        self._redispatches = Counter(
            "kvguard_proxy_redispatches", "Requests re-dispatched away from a replica before "
            "any response byte", ["replica"], registry=registry)
        self._failures = Counter(
            "kvguard_proxy_upstream_failures", "Failed upstream requests by kind",
            ["replica", "kind"], registry=registry)
        ejections = Gauge("kvguard_proxy_ejections_total", "Times the replica was ejected",
                          ["replica"], registry=registry)
        routable_gauge = Gauge("kvguard_proxy_replica_routable",
                               "1 while the policy may route to the replica", ["replica"],
                               registry=registry)
        for replica_id in replica_ids:
            self._redispatches.labels(replica_id)
            ejections.labels(replica_id).set_function(
                lambda rid=replica_id: num_ejections(rid))
            routable_gauge.labels(replica_id).set_function(
                lambda rid=replica_id: 1.0 if routable(rid) else 0.0)

    def redispatched(self, replica_id: str) -> None:
        self._redispatches.labels(replica_id).inc()

    def upstream_failure(self, replica_id: str, kind: str) -> None:
        self._failures.labels(replica_id, kind).inc()
