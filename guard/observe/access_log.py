"""``AccessLog``: one log line per request that reached the guard (``--access-log``).

It takes the same records as the trace file (:mod:`guard.observe.trace`: one per admitted
request at its release, one per rejection) and logs each on the ``kvguard.access`` logger at
INFO, with the fields ``id`` (the guard's request id), ``tenant``, ``model``, ``replica``,
``decision`` (admit, queue, shed), ``status``, ``outcome``, ``ttft_ms``, ``prompt_tokens``,
``output_tokens`` and ``duration_ms`` (arrival to the end of the response). ``TraceTee`` feeds
one record to both when a trace file is written too.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["ACCESS_LOGGER", "AccessLog", "TraceTee", "with_access_log"]

ACCESS_LOGGER = "kvguard.access"


def _ms(start_s: float | None, end_s: float | None) -> float | None:
    if start_s is None or end_s is None:
        return None
    return round((end_s - start_s) * 1000.0, 1)


class AccessLog:
    """A trace-record sink that logs each record as one access line."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger(ACCESS_LOGGER)
        self._log.setLevel(logging.INFO)  # on whenever it is configured, whatever --log-level

    def write(self, record: dict[str, Any]) -> None:
        arrival_s = record.get("arrival_s")
        fields = {
            "id": record.get("request_id"), "tenant": record.get("tenant"),
            "model": record.get("model"), "replica": record.get("replica"),
            "decision": record.get("decision"), "status": record.get("status"),
            "outcome": record.get("outcome"),
            "ttft_ms": _ms(arrival_s, record.get("first_token_s")),
            "prompt_tokens": record.get("num_prompt_tokens"),
            "output_tokens": record.get("num_output_tokens"),
            "duration_ms": _ms(arrival_s, record.get("completion_s")),
        }
        if record.get("reason"):
            fields["reason"] = record["reason"]
        self._log.info("request", extra={"fields": fields})

    def flush(self) -> None:
        """Lines go out as they are logged."""

    def close(self) -> None:
        """Nothing is held open."""


def with_access_log(trace: Any) -> Any:
    """The trace sink to use with the access log on: the log alone, or both (``trace``: the
    controller's trace file, or None)."""
    return AccessLog() if trace is None else TraceTee(trace, AccessLog())


class TraceTee:
    """Several trace-record sinks fed the same records."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
