"""The proxy's own Prometheus series, on the guard's registry (served at ``/kvguard/metrics``).

* ``kvguard_proxy_redispatches_total{replica}``: requests moved off ``replica`` before any
  the request reached it (connect error, a pooled connection found closed, the replica's 503).
* ``kvguard_proxy_upstream_failures_total{replica,kind}``: ``kind`` is ``unreachable``,
  ``timeout``, ``status`` (a 5xx answer), ``unavailable`` (a 503, not counted toward
  ejection), ``broken`` (closed after the request was written, or a response cut mid-way) or
  ``malformed`` (not valid HTTP/1.1; not counted toward ejection).
* ``kvguard_proxy_ejections_total{replica}``: times the replica was ejected (a counter).
* ``kvguard_proxy_replica_routable{replica}``: 1 while the policy may pick it.
* ``kvguard_proxy_replica_state_readable{replica}``: 0 while its last state refresh failed
  (``/kvguard/state`` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, replica_ids: list[str],
                 routable: Callable[[str], bool],
                 state_error: Callable[[str], str | None]) -> None:
        self._redispatches = Counter(
            "kvguard_proxy_redispatches", "Requests re-dispatched away from a replica before "
            "any response byte", ["replica"], registry=registry)
        self._failures = Counter(
            "kvguard_proxy_upstream_failures", "Failed upstream requests by kind",
            ["replica", "kind"], registry=registry)
        self._ejections = Counter("kvguard_proxy_ejections", "Times the replica was ejected",
                                  ["replica"], registry=registry)
        readable = Gauge("kvguard_proxy_replica_state_readable",
                         "0 while the replica's last state refresh failed", ["replica"],
                         registry=registry)
        routable_gauge = Gauge("kvguard_proxy_replica_routable",
                               "1 while the policy may route to the replica", ["replica"],
                               registry=registry)
        self._failure_kinds: dict[str, set[str]] = {}  # the series made, to remove them
        self._readable, self._routable = readable, routable_gauge
        self._state_error, self._is_routable = state_error, routable
        for replica_id in replica_ids:
            self.add(replica_id)

    def add(self, replica_id: str) -> None:
        """The replica's series (a replica joined the fleet)."""
        state_error, routable = self._state_error, self._is_routable
        self._redispatches.labels(replica_id)
        self._ejections.labels(replica_id)
        self._readable.labels(replica_id).set_function(
            lambda rid=replica_id: 0.0 if state_error(rid) else 1.0)
        self._routable.labels(replica_id).set_function(
            lambda rid=replica_id: 1.0 if routable(rid) else 0.0)

    def remove(self, replica_id: str) -> None:
        """A replica left the fleet: its series go (a scrape no longer shows it)."""
        for metric in (self._redispatches, self._ejections, self._readable, self._routable):
            with contextlib.suppress(KeyError):
                metric.remove(replica_id)
        for kind in self._failure_kinds.pop(replica_id, ()):
            self._failures.remove(replica_id, kind)

    def redispatched(self, replica_id: str) -> None:
        self._redispatches.labels(replica_id).inc()

    def ejected(self, replica_id: str) -> None:
        self._ejections.labels(replica_id).inc()

    def upstream_failure(self, replica_id: str, kind: str) -> None:
        self._failure_kinds.setdefault(replica_id, set()).add(kind)
        self._failures.labels(replica_id, kind).inc()
