"""Forwarding one admitted request to its replica: relay, failover and the failure answers.

:meth:`Forwarder.forward` sends the request body to the replica the policy chose and relays the
answer to the client:

* **streams** (``text/event-stream``) pass through unbuffered, chunk by chunk;
* **JSON** answers are read whole, then sent (the engine sends them in one piece anyway), so a
  failure half-way still becomes a clean 502;
* a failure **before any response** (connect refused or timed out, connection closed, garbage
  status line, or the replica's own 503) is re-dispatched once to another routable replica
  (``redispatch``) and counted; if there is none, or the second try fails too: 502
  ``upstream_failed``;
* an upstream that stays silent past ``read_timeout_s``: 504 ``upstream_timeout`` before the
  response began, an SSE error event after;
* any other 5xx answer: 502 ``upstream_failed`` (the upstream's status in the message);
* a stream cut mid-way ends for the client with ``data: {"error": {...}}`` (no ``[DONE]``), so
  the ticket is released ``failed``;
* every relayed response names its replica in ``x-kvguard-replica``;
* the client's disconnect cancels the forwarding at once and aborts the upstream connection
  (the replica sees its client go and frees the sequence's KV blocks).

Every connect error, timeout and 5xx is a failure for :class:`guard.proxy.health.ReplicaHealth`
(ejection); any other answer is a success.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from guard.proxy.health import ReplicaHealth
from guard.proxy.transports import (
    Transport,
    UpstreamBroken,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from guard.rejection import Rejection, send_rejection

__all__ = ["Forwarder", "sse_error_event", "REPLICA_HEADER"]

REPLICA_HEADER = b"x-kvguard-replica"  # which replica answered, on every relayed response

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
# redispatch(ticket, failed_replica_id) -> the new replica id, or None when there is none
Redispatch = Callable[[Any, str], "str | None"]


def sse_error_event(code: str, message: str) -> bytes:
    """The SSE event that ends a broken stream (OpenAI SDKs raise on it)."""
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


class _ClientGone(Exception):
    """The client disconnected while we were forwarding."""


class Forwarder:
    """Forwards admitted requests; shared by all requests of one proxy."""

    def __init__(self, urls: Mapping[str, str], transport: Transport, health: ReplicaHealth,
                 redispatch: Redispatch, counters: Any) -> None:
        self._urls = dict(urls)
        self._transport = transport
        self._health = health
        self._redispatch = redispatch
        self._counters = counters  # .redispatched(replica_id), .upstream_failure(replica_id, kind)

    async def forward(self, ticket: Any, path: str, headers: Headers, body: bytes,
                      receive: Receive, send: Send) -> None:
        """Relay one request; returns normally on every outcome (the ticket judges it)."""
        task = asyncio.current_task()
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, gone, task))
        response: UpstreamResponse | None = None
        try:
            response = await self._open(ticket, path, headers, body, send)
            if response is not None:
                await self._relay(ticket.replica_id, response, send)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            task.uncancel()
        except OSError:  # the client's socket failed while we sent: it is gone
            pass
        finally:
            watcher.cancel()
            if response is not None:
                await response.aclose()

    async def _open(self, ticket: Any, path: str, headers: Headers, body: bytes,
                    send: Send) -> UpstreamResponse | None:
        """The upstream's response head, after at most one re-dispatch; None if answered."""
        for attempt in (0, 1):
            replica_id = ticket.replica_id
            try:
                response = await self._transport.send(self._urls[replica_id] + path, headers, body)
            except UpstreamUnreachable as exc:
                failure = str(exc)
            except UpstreamTimeout as exc:
                self._fail(replica_id, "timeout")
                await send_rejection(send, Rejection(504, "upstream_timeout", str(exc),
                                                     should_retry=True))
                return None
            else:
                if response.status != 503:
                    return response
                failure = f"replica {replica_id} answered 503"
                await response.aclose()
            self._fail(replica_id, "unreachable")
            if attempt == 0 and self._redispatch(ticket, replica_id) is not None:
                self._counters.redispatched(replica_id)
                continue
            break
        await send_rejection(send, Rejection(502, "upstream_failed",
                                             f"no replica could take the request: {failure}",
                                             should_retry=True))
        return None

    async def _relay(self, replica_id: str, response: UpstreamResponse, send: Send) -> None:
        status = response.status
        if status >= 500:
            self._fail(replica_id, "status")
            await send_rejection(send, Rejection(
                502, "upstream_failed", f"replica {replica_id} answered HTTP {status}",
                should_retry=True))
            return
        is_stream = _is_event_stream(response.headers)
        if not is_stream:
            try:
                body = b"".join([chunk async for chunk in response.chunks()])
            except UpstreamError as exc:
                timeout = isinstance(exc, UpstreamTimeout)
                self._fail(replica_id, "timeout" if timeout else "broken")
                await send_rejection(send, Rejection(
                    504 if timeout else 502, "upstream_timeout" if timeout else "upstream_failed",
                    str(exc), should_retry=True))
                return
            self._health.record_success(replica_id)
            headers = [*response.headers, (REPLICA_HEADER, replica_id.encode()),
                       (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        self._health.record_success(replica_id)
        headers = [*response.headers, (REPLICA_HEADER, replica_id.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        try:
            async for chunk in response.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (UpstreamTimeout, UpstreamBroken) as exc:
            timeout = isinstance(exc, UpstreamTimeout)
            self._fail(replica_id, "timeout" if timeout else "broken")
            code = "upstream_timeout" if timeout else "upstream_failed"
            await send({"type": "http.response.body", "body": sse_error_event(code, str(exc)),
                        "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _fail(self, replica_id: str, kind: str) -> None:
        self._counters.upstream_failure(replica_id, kind)
        self._health.record_failure(replica_id)


async def _watch_disconnect(receive: Receive, gone: asyncio.Event, task: asyncio.Task) -> None:
    """Cancel ``task`` when the client disconnects (other messages are ignored)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            task.cancel()
            return


def _is_event_stream(headers: Headers) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.startswith(b"text/event-stream")
    return False
