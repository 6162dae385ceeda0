"""uvicorn's HTTP/1.1 protocol (h11 or httptools) with the ``ServerLimits`` enforced on each
connection.

Why a protocol layer and not ASGI middleware: an ASGI app is called only once the request head
is complete, so it can never see a client that trickles its headers or opens a connection and
sends nothing; and uvicorn arms its keep-alive timer only after a first response. Here each
connection moves through phases, one deadline at a time:

    head     accepted, or the first byte of the next request arrived: head within header_timeout_s
    body     head complete, body still arriving: body within body_timeout_s (total)
    serving  the request is read; the response streams for as long as it takes, but a client
             that stops reading (writes paused) is cut after write_timeout_s
    idle     response complete: uvicorn's keep-alive timer (keep_alive_timeout_s) runs

A deadline that passes closes the connection; the app then sees ``http.disconnect``, which frees
whatever the request held. A connection over ``max_connections`` or over
``max_connections_per_client`` is answered 503 (``Retry-After: 1``) and closed before uvicorn
sees it.

``ConnectionTable`` counts the open connections per client address and the closes by reason
(``header_timeout``, ``body_timeout``, ``write_timeout``, ``over_capacity``); ``uvicorn_config(app, table)`` builds
the uvicorn ``Config`` that uses this protocol.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from serving.server_limits import ServerLimits

__all__ = ["REFUSAL", "REFUSAL_LINGER_S", "ConnectionTable", "PhaseDeadlines",
           "limited_protocol_class", "uvicorn_config"]

_REFUSAL_BODY = json.dumps({"error": {
    "message": "Too many open connections; retry shortly.", "type": "server_error",
    "param": None, "code": "too_many_connections"}}).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
            + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)
REFUSAL_LINGER_S = 1.0
_TIMEOUT_REASONS = {"head": "header_timeout", "body": "body_timeout"}
# a timer may run a little before its time (the loop's clock resolution; libuv counts whole
# milliseconds): that close to the due time the deadline has passed
_EARLY_S = 0.002


class PhaseDeadlines:
    """One deadline at a time for a connection's current phase (mixed into both servers'
    protocols). The protocol sets ``loop``, ``transport``, ``_phase`` and ``_deadline`` (None)
    and names its ``_connection_table()``; a head or body deadline that passes is counted there
    by reason, and any deadline that passes closes the connection.

    The timer is lazy: a new phase only writes down when it is due (``_due``), and the timer
    already running stays when it fires no later than that — on firing it finds the phase's
    real due time and, when that is still ahead, sets itself again for it. A keep-alive
    connection serving request after request thus starts a timer about once per timeout, not
    two per request (timer churn showed up in profiles of a flood of sheds; docs/benchmarks.md
    §7 has the measurement); a phase whose deadline is nearer than the running timer's
    replaces it."""

    _phase: str
    _deadline: Any
    _due: float | None = None  # loop time the current phase's deadline passes; None: no deadline

    def _arm(self, phase: str, timeout_s: float | None) -> None:
        self._phase = phase
        if timeout_s is None:
            self._due = None  # a running timer finds nothing due and lapses
            return
        self._due = due = self.loop.time() + timeout_s
        timer = self._deadline
        if timer is not None:
            if timer.when() <= due:
                return  # it fires first and sets itself again for ``due``
            timer.cancel()
        self._deadline = self.loop.call_at(due, self._expire)

    def _cancel(self) -> None:
        self._due = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        due = self._due
        transport = self.transport
        if due is None or transport is None or transport.is_closing():
            return
        if self.loop.time() < due - _EARLY_S:  # the phase changed since: its own deadline
            self._deadline = self.loop.call_at(due, self._expire)
            return
        reason = _TIMEOUT_REASONS.get(self._phase)  # keep-alive idle: closed, not counted
        if reason is not None:
            self._connection_table().closed(reason)
        transport.close()


class ConnectionTable:
    """Open connections per client address, and connections closed by reason (one per server)."""

    def __init__(self, limits: ServerLimits,
                 on_close: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.num_open = 0
        self.num_open_by_client: Counter[str] = Counter()
        self.num_closed_by_reason: Counter[str] = Counter()
        self._on_close = on_close

    def try_open(self, client: str) -> bool:
        """Count a new connection from ``client``; False (nothing counted) when over a cap."""
        cap, per_client = self.limits.max_connections, self.limits.max_connections_per_client
        if (cap and self.num_open >= cap) or (
                per_client and self.num_open_by_client[client] >= per_client):
            self.closed("over_capacity")
            return False
        self.num_open += 1
        self.num_open_by_client[client] += 1
        return True

    def release(self, client: str) -> None:
        self.num_open -= 1
        self.num_open_by_client[client] -= 1
        if self.num_open_by_client[client] <= 0:
            del self.num_open_by_client[client]

    def closed(self, reason: str) -> None:
        self.num_closed_by_reason[reason] += 1
        if self._on_close is not None:
            self._on_close(reason)


def _base_protocol(http: str) -> type:
    """uvicorn's protocol class for ``http``: ``h11``, ``httptools``, or ``auto`` (httptools
    when installed, as uvicorn chooses)."""
    if http == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            http = "h11"
        else:
            http = "httptools"
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    raise ValueError(f"http must be auto, h11 or httptools, got {http!r}")


def limited_protocol_class(table: ConnectionTable, http: str = "h11") -> type:
    """A subclass of uvicorn's ``http`` protocol bound to ``table`` (one class per server).
    Both of uvicorn's HTTP/1.1 protocols keep the request cycle the same way (``cycle``,
    ``more_body``, ``response_complete``), which is all the phases read."""
    base = _base_protocol(http)
    limits = table.limits

    class LimitedProtocol(PhaseDeadlines, base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._client_addr: str | None = None  # set once counted in the table
            self._phase = "head"
            self._deadline = None  # asyncio.TimerHandle of the current phase
            self._write_deadline = None  # armed while the client does not read

        def connection_made(self, transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if peer else "unknown"
            if not table.try_open(client):
                self._refuse(transport)
                return
            self._client_addr = client
            super().connection_made(transport)
            self._arm("head", limits.header_timeout_s)

        def _refuse(self, transport) -> None:
            """503, then a lingering close: half-close, discard what the client still sends,
            close when it does or after ``REFUSAL_LINGER_S`` (closing at once with its request
            unread would reset the connection and lose the 503)."""
            transport.write(REFUSAL)
            if transport.can_write_eof():
                transport.write_eof()
            self._deadline = self.loop.call_later(REFUSAL_LINGER_S, transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._client_addr is None:  # refused: uvicorn never saw it
                self._cancel()
                return
            self._cancel()
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None
            table.release(self._client_addr)
            self._client_addr = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._client_addr is None:
                return
            if self._phase == "idle":  # the first byte of the next request
                self._arm("head", limits.header_timeout_s)
            super().data_received(data)
            self._follow_request()

        def pause_writing(self) -> None:
            """The client stopped reading: it has ``write_timeout_s`` to start again."""
            super().pause_writing()
            if self._write_deadline is None and self._client_addr is not None:
                self._write_deadline = self.loop.call_later(limits.write_timeout_s,
                                                            self._expire_write)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _expire_write(self) -> None:
            self._write_deadline = None
            if self.transport is not None and not self.transport.is_closing():
                table.closed("write_timeout")
                self.transport.abort()  # close() would wait for the unread buffer to drain

        def on_response_complete(self) -> None:
            self._arm("idle", None)  # uvicorn's keep-alive timer takes over
            super().on_response_complete()
            self._follow_request()  # a pipelined request may have started

        def _follow_request(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return  # still reading a head (or idle)
            if cycle.more_body:
                if self._phase == "head":
                    self._arm("body", limits.body_timeout_s)
            elif self._phase in ("head", "body"):
                self._arm("serving", None)

        def _connection_table(self) -> ConnectionTable:
            return table

    return LimitedProtocol


def uvicorn_config(app, table: ConnectionTable, http: str = "h11", **kwargs: Any):
    """A ``uvicorn.Config`` serving ``app`` over uvicorn's ``http`` protocol (``h11``,
    ``httptools`` or ``auto``) with ``table.limits`` enforced."""
    import uvicorn

    return uvicorn.Config(app, http=limited_protocol_class(table, http),
                          timeout_keep_alive=table.limits.keep_alive_timeout_s, **kwargs)
