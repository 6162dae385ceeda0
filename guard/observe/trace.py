"""The guard's request trace: one JSON line per request that reached the guard.

Timestamps are the guard's monotonic clock in seconds (``*_s``); readers join with the engine's
trace (``engine/trace.py``) on ``request_id`` (the ``x-request-id`` the guard sends upstream)
and compare only differences within one trace. One line looks like::

    {"source": "guard", "request_id": "5f0c2a9e-1b7d-4c3a-9e21-00000000001a", "tenant": "acme", "class": "interactive",
     "replica": "local", "upstream_request_id": "5f0c2a9e-1b7d-4c3a-9e21-00000000001a", "decision": "admit",
     "arrival_s": 10.0, "decision_s": 10.0001, "enqueue_s": null, "dispatch_s": 10.0001,
     "first_byte_s": 10.2, "first_token_s": 10.2, "completion_s": 10.9,
     "predicted_ttft_s": 0.18, "outcome": "completed", "status": 200, "met_slo": true,
     "itl_limit_s": 0.08, "chunks_s": [10.2, 10.25, ...]}

``chunks_s`` (admitted requests): when the relay had forwarded each content chunk (its send to
the client returned), in order — ``kvguard timeline`` lines them up with the engine's per-token
records; ``itl_limit_s``: the class's inter-token limit, the bar its gaps are judged against.

Cost: an admitted request's line carries what the guard can attribute to it, the network at
the guard: ``num_request_bytes`` (the body sent upstream), ``num_response_bytes`` (the body
relayed back) and ``network_usd`` at ``[cost] network_usd_per_gb`` (0 without a price). Its
accelerator cost is not on the line: the guard does not see the engine's steps, which several
requests share; ``kvguard cost`` attributes them offline from the replicas' step traces,
joined on ``upstream_request_id`` (and it takes each window's network from these lines).
A shed request's line has no cost fields: it reached no replica, and the guard's network
counter counts admitted bodies only.

``decision`` is ``admit``, ``queue`` (then admitted or shed from the queue) or ``shed``;
``outcome`` is ``completed``, ``canceled``, ``failed``, ``rejected_upstream`` or ``rejected``.
Lines are buffered and written in batches: when ``max_buffered`` lines wait, when a write comes
``flush_interval_s`` after the last flush, and whenever the owner calls :meth:`TraceWriter.flush`
(the controller does once a second and on shutdown); :meth:`TraceWriter.close` flushes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TextIO

from guard.admission.ticket import Ticket

__all__ = ["TraceWriter", "ticket_record", "rejection_record"]


class TraceWriter:
    def __init__(self, out: TextIO, max_buffered: int = 256, *, flush_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {max_buffered}")
        if flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        self._out = out
        self._buffer: list[str] = []
        self.max_buffered = max_buffered
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._flushed_s = clock()
        self.closed = False

    @classmethod
    def open(cls, path: str, max_buffered: int = 256, *, flush_interval_s: float = 1.0,
             clock: Callable[[], float] = time.monotonic) -> TraceWriter:
        try:
            out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - close()
        except OSError as exc:
            raise ValueError(f"trace_path: cannot open {path!r}: {exc.strerror}") from None
        return cls(out, max_buffered, flush_interval_s=flush_interval_s, clock=clock)

    def write(self, record: dict[str, Any]) -> None:
        if self.closed:
            return
        self._buffer.append(json.dumps(record, separators=(",", ":")))
        if (len(self._buffer) >= self.max_buffered
                or self._clock() - self._flushed_s >= self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        if self.closed:
            return
        self._flushed_s = self._clock()
        if self._buffer:
            self._out.write("\n".join(self._buffer) + "\n")
            self._buffer.clear()
        self._out.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        self.closed = True
        self._out.close()


def ticket_record(ticket: Ticket, decision: str, decision_s: float,
                  enqueue_s: float | None, network_usd_per_byte: float = 0.0) -> dict[str, Any]:
    cost = ticket.cost
    num_bytes = ticket.num_request_bytes + ticket.num_response_bytes
    return {
        "source": "guard", "request_id": cost.request_id, "tenant": cost.tenant,
        "class": cost.request_class.name, "replica": ticket.replica_id,
        "upstream_request_id": cost.request_id, "decision": decision,
        "arrival_s": cost.arrival_s, "decision_s": decision_s, "enqueue_s": enqueue_s,
        "dispatch_s": ticket.dispatch_s, "first_byte_s": ticket.first_byte_s,
        "first_token_s": ticket.first_token_s, "completion_s": ticket.released_s,
        "predicted_ttft_s": ticket.predicted_ttft_s, "outcome": ticket.outcome,
        "status": ticket.status, "met_slo": ticket.slo_met,
        "num_prompt_tokens": cost.num_prompt_tokens, "num_content_chunks": ticket.num_content_chunks,
        "itl_limit_s": cost.request_class.itl_s, "chunks_s": ticket.chunks_s,
        "model": _model(ticket), "num_output_tokens": _num_output_tokens(ticket),
        "num_request_bytes": ticket.num_request_bytes,
        "num_response_bytes": ticket.num_response_bytes,
        "network_usd": num_bytes * network_usd_per_byte,
    }


def _model(ticket: Ticket) -> str | None:
    priced = ticket.priced
    model = priced.body.get("model") if priced is not None else None
    return model if isinstance(model, str) else None


def _num_output_tokens(ticket: Ticket) -> int | None:
    """The upstream's ``usage`` count; for a stream without one, its content chunks."""
    output = ticket.num_usage_output_tokens
    if output is None and ticket.is_stream:
        output = ticket.num_content_chunks
    return output


def rejection_record(request_id: str, tenant: str, class_name: str | None, arrival_s: float,
                     decision_s: float, enqueue_s: float | None, status: int,
                     reason: str, outcome: str = "rejected") -> dict[str, Any]:
    return {
        "source": "guard", "request_id": request_id, "tenant": tenant, "class": class_name,
        "replica": None, "upstream_request_id": None,
        "decision": "queue" if enqueue_s is not None else "shed",
        "arrival_s": arrival_s, "decision_s": decision_s, "enqueue_s": enqueue_s,
        "dispatch_s": None, "first_byte_s": None, "first_token_s": None,
        "completion_s": decision_s, "predicted_ttft_s": None, "outcome": outcome,
        "status": status, "reason": reason, "met_slo": False,
    }
