"""Forwarding one admitted request to its replica: relay, failover and the failure answers.

:meth:`Forwarder.forward` sends the request body to the replica the policy chose and relays the
answer to the client:

* **streams** (``text/event-stream``) pass through unbuffered, chunk by chunk;
* **JSON** answers are read whole, then sent (the engine sends them in one piece anyway), so a
  failure half-way still becomes a clean 502;
* a failure **before the request reached the replica** (connect refused or timed out, a pooled
  connection found closed before the write) or the replica's own 503 is re-dispatched once to
  another routable replica (``redispatch``) and counted; if there is none, or the second try
  fails too: 502 ``upstream_failed`` (a replica's 503 is relayed as it is, with its own
  Retry-After, and does not count toward ejection: the replica answered);
* once the request was written it is never sent again (RFC 9110 §9.2.2): a connection closed
  before the answer is a 502 ``upstream_failed``; so is an answer that is not valid HTTP/1.1
  (a bad status line or header field, an unsupported framing), which does not count toward
  ejection either (a response, however odd, is not a dead replica);
* an upstream that stays silent past ``read_timeout_s``: 504 ``upstream_timeout`` before the
  response began, an SSE error event after;
* any other 5xx answer: 502 ``upstream_failed`` (the upstream's status in the message);
* a stream cut mid-way ends for the client with ``data: {"error": {...}}`` (no ``[DONE]``), so
  the ticket is released ``failed``;
* every relayed response names its replica in ``x-kvguard-replica``;
* on kvguard's own server with the ``h1`` client a stream's chunks go to the client from the
  upstream connection's read callback (the server's ``kvguard.body`` extension), not through a
  task wake-up per chunk; while the client does not read, reading from the upstream pauses;
* the client's disconnect cancels the forwarding at once and aborts the upstream connection
  (the replica sees its client go and frees the sequence's KV blocks);
* :meth:`Forwarder.cut_all` (the proxy's drain deadline) ends every relay still running: a
  stream with an SSE error event ``shutting_down``, a response not begun with a 503
  ``shutting_down``; the upstream request is aborted as on a disconnect;
* once a response's last bytes are written to the client, the proxy yields its CPU once
  (``sched_yield``) before the bookkeeping that follows (the relay's end, the pool, the
  ticket's release): a client on the same machine that the write woke is often queued on the
  proxy's own core (the kernel places a socket's reader beside its writer) and would wait out
  that bookkeeping before it reads the end. With nothing else runnable it returns at once.

Every connect error, timeout and 5xx but 503 is a failure for :class:`guard.proxy.health.ReplicaHealth`
(ejection); any other answer is a success.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from guard.admission.admitted import Admitted
from guard.admission.shedding import Rejection
from guard.proxy.failure_messages import failure_message
from guard.proxy.health import ReplicaHealth
from guard.proxy.transports import (
    Transport,
    UpstreamBroken,
    UpstreamError,
    UpstreamMalformed,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from guard.relay import REQUEST_ID_HEADER
from guard.request.request_ids import MAX_TOKENS_HEADER, id_headers
from policies.shed_reasons import SHUTTING_DOWN

__all__ = ["BodyWriter", "Forwarder", "sse_error_event", "yield_cpu", "REPLICA_HEADER"]

REPLICA_HEADER = b"x-kvguard-replica"  # which replica answered, on every relayed response
QUEUE_MS_HEADER = b"x-kvguard-queue-ms"

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
# the server's direct body writer (serving.h1_exchange ``kvguard.body``): (write_body, drain)
BodyWriter = tuple[Callable[[bytes, bool], bool], Callable[[], Awaitable[None]]]
# redispatch(admission, failed_replica_id) -> the new replica id, or None when there is none
Redispatch = Callable[[Admitted, str], "str | None"]


# called once a response's last bytes are written: a task that write woke runs first (see the
# module docstring); Unix has it, elsewhere there is nothing to do
yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def sse_error_event(code: str, message: str, responses: bool = False) -> bytes:
    """The SSE event that ends a broken stream (OpenAI SDKs raise on it); a /v1/responses
    stream gets the Responses API's typed ``error`` event."""
    if responses:
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


class Forwarder:
    """Forwards admitted requests; shared by all requests of one proxy.

    ``redispatch(admission, failed_replica_id)`` moves an admission whose replica failed before
    answering to another replica (returns its id, or None when there is none).
    """

    def __init__(self, urls: Mapping[str, str], transport: Transport, health: ReplicaHealth,
                 redispatch: Redispatch, counters: Any,
                 api_keys: Mapping[str, str] | None = None) -> None:
        self._urls = dict(urls)
        # replica id -> its Authorization value: the proxy's own key for it, on every attempt
        self._authorizations = {rid: b"Bearer " + key.encode()
                                for rid, key in (api_keys or {}).items()}
        self._transport = transport
        self._health = health
        self._redispatch = redispatch
        self._counters = counters  # .redispatched(replica_id), .upstream_failure(replica_id, kind)
        self._send_now = getattr(transport, "send_now", None)  # h1 only
        self._watches: set[_Watch] = set()  # the relays running now (for cut_all)

    def set_replica(self, replica_id: str, url: str, api_key: str | None) -> None:
        """A replica joined the fleet (or its credential changed)."""
        self._urls[replica_id] = url
        if api_key is not None:
            self._authorizations[replica_id] = b"Bearer " + api_key.encode()
        else:
            self._authorizations.pop(replica_id, None)

    def drop(self, replica_id: str) -> None:
        """A replica left the fleet and nothing is in flight to it any more."""
        self._urls.pop(replica_id, None)
        self._authorizations.pop(replica_id, None)

    def send_now(self, replica_id: str, path: str, headers: Headers, body: bytes,
                 request_id: str) -> Awaitable[UpstreamResponse] | None:
        """The request written to ``replica_id`` at once when the transport can (``h1``, an
        idle pooled connection): the awaitable of the response head, for :meth:`forward`'s
        ``sent`` (it must be handed there, with the admission of the same request and body).
        None otherwise: :meth:`forward` sends it. ``headers``: the client's, as kvguard's
        server parsed them; they go with ``x-request-id: request_id`` (hop-by-hop ones and
        the client's own ``x-request-id`` left out: what ``forward``'s headers hold)."""
        send_now = self._send_now
        if send_now is None:
            return None
        return send_now(self._urls[replica_id] + path, self.credentialed(replica_id, headers),
                        body, request_id)

    def credentialed(self, replica_id: str, headers: Headers) -> Headers:
        """``headers`` with the replica's own ``Authorization`` in place of any other."""
        authorization = self._authorizations.get(replica_id)
        if authorization is None:
            return headers
        return [h for h in headers if h[0] != b"authorization"] + [
            (b"authorization", authorization)]

    def cut_all(self) -> int:
        """End every running relay now (see the module docstring); how many there were."""
        watches = list(self._watches)
        for watch in watches:
            watch.cut()
        return len(watches)

    async def forward(self, admission: Admitted, path: str, headers: Headers,
                      gone: asyncio.Future, send: Send, writer: BodyWriter | None = None,
                      sent: Awaitable[UpstreamResponse] | None = None) -> None:
        """Relay one admitted request and finish its admission exactly once. ``gone`` completes
        when the client disconnects; the relay then stops at once. ``writer``: the server's
        direct body writer, when it has one. ``sent``: :meth:`send_now`'s awaitable, when the
        request was already written (its first attempt)."""
        admission.ticket.num_request_bytes = len(admission.body)  # network cost
        client = _Client(admission, send, writer)
        watch = _Watch(admission, asyncio.current_task())
        gone.add_done_callback(watch.on_gone)
        self._watches.add(watch)
        response: UpstreamResponse | None = None
        error: BaseException | None = None
        try:
            response = await self._open(admission, path, headers, admission.body, client, sent)
            if response is not None:
                await self._relay(admission.replica_id, response, client)
        except asyncio.CancelledError as exc:
            if watch.was_cut and not watch.client_left:
                watch.task.uncancel()
                await client.cut()
            elif not watch.client_left:
                error = exc
                raise
            else:
                watch.task.uncancel()
        except OSError:  # the client's socket failed while we sent: it is gone
            admission.on_disconnect()
        except BaseException as exc:
            error = exc
            raise
        finally:
            watch.relaying = False
            self._watches.discard(watch)
            gone.remove_done_callback(watch.on_gone)
            if response is not None:
                await response.aclose()  # aborts the upstream request unless it was read whole
            admission.finish(error)

    async def _open(self, admission: Admitted, path: str, headers: Headers, body: bytes,
                    client: _Client, sent: Awaitable[UpstreamResponse] | None
                    ) -> UpstreamResponse | None:
        """The upstream's response head, after at most one re-dispatch; None if answered."""
        for attempt in (0, 1):
            replica_id = admission.replica_id
            try:
                if sent is not None:  # the first attempt, written already
                    sent, pending = None, sent
                    response = await pending
                else:
                    response = await self._transport.send(
                        self._urls[replica_id] + path, self.credentialed(replica_id, headers),
                        body)
            except UpstreamUnreachable as exc:
                failure = failure_message(replica_id, exc)
            except UpstreamTimeout as exc:
                self._fail(replica_id, "timeout")
                await client.reject(Rejection(504, "upstream_timeout",
                                              failure_message(replica_id, exc), should_retry=True))
                return None
            except UpstreamBroken as exc:  # the request went out: not sent again
                self._fail(replica_id, "broken", exc)
                await client.reject(Rejection(502, "upstream_failed",
                                              failure_message(replica_id, exc),
                                              should_retry=True))
                return None
            else:
                if response.status != 503:
                    return response
                # a replica that answers 503 (over its connection cap, shutting down) is alive:
                # the request moves on, the replica is not ejected for it
                self._counters.upstream_failure(replica_id, "unavailable")
                if attempt == 1 or self._redispatch(admission, replica_id) is None:
                    return response  # the replica's own 503 (and Retry-After) goes to the client
                await response.aclose()
                self._counters.redispatched(replica_id)
                continue
            self._fail(replica_id, "unreachable")
            if attempt == 0 and self._redispatch(admission, replica_id) is not None:
                self._counters.redispatched(replica_id)
                continue
            break
        await client.reject(Rejection(502, "upstream_failed",
                                      f"no replica could take the request: {failure}",
                                      should_retry=True))
        return None

    async def _relay(self, replica_id: str, response: UpstreamResponse, client: _Client) -> None:
        status = response.status
        if status >= 500 and status != 503:
            self._fail(replica_id, "status")
            await client.reject(Rejection(
                502, "upstream_failed", f"replica {replica_id} answered HTTP {status}",
                should_retry=True))
            return
        is_stream = _is_event_stream(response.headers)
        if not is_stream:
            try:
                body = b"".join([chunk async for chunk in response.chunks()])
            except UpstreamError as exc:
                timeout = isinstance(exc, UpstreamTimeout)
                self._fail(replica_id, "timeout" if timeout else "broken", exc)
                await client.reject(Rejection(
                    504 if timeout else 502, "upstream_timeout" if timeout else "upstream_failed",
                    failure_message(replica_id, exc), should_retry=True))
                return
            if status < 500:
                self._health.record_success(replica_id)
            await client.start(status, [*response.headers,
                                        (b"content-length", str(len(body)).encode())])
            await client.body(body, False)
            return
        if status < 500:
            self._health.record_success(replica_id)
        await client.start(status, response.headers)
        ended = False
        try:
            if client.writer is not None and hasattr(response, "push"):
                ended = await _push(response, client)
            else:
                async for chunk in response.chunks():
                    ended = response.ended  # the last chunk carries the end: one write
                    await client.body(chunk, not ended)
        except (UpstreamTimeout, UpstreamBroken) as exc:
            timeout = isinstance(exc, UpstreamTimeout)
            self._fail(replica_id, "timeout" if timeout else "broken", exc)
            code = "upstream_timeout" if timeout else "upstream_failed"
            await client.body(sse_error_event(code, failure_message(replica_id, exc),
                                              client.admission.ticket.responses), False)
            return
        if not ended:
            await client.body(b"", False)

    def _fail(self, replica_id: str, kind: str, exc: BaseException | None = None) -> None:
        """Counted; and held against the replica's health unless its answer was malformed."""
        if isinstance(exc, UpstreamMalformed):
            self._counters.upstream_failure(replica_id, "malformed")
            return
        self._counters.upstream_failure(replica_id, kind)
        self._health.record_failure(replica_id)


async def _push(response: Any, client: _Client) -> bool:
    """The stream handed on from the upstream's read callback; True when its last chunk
    carried the end of the response."""
    sink = _Sink(client, response)
    drain = client.writer[1]
    while not await response.push(sink):
        if sink.error is not None:
            raise sink.error
        await drain()  # the client stopped reading: on once it reads again
    if sink.error is not None:
        raise sink.error
    return sink.ended


class _Sink:
    """``sink(data, last)`` for :meth:`push`: what :meth:`_Client.body` does, called from the
    upstream protocol (so it never raises: an error stops the push and is raised after it).
    The chunk goes to the client first and the admission sees it right after, stamped with the
    time it went (the first token does not wait for the bookkeeping)."""

    __slots__ = ("_admission", "_clock", "_write", "_response", "_forwarded", "ended", "error")

    def __init__(self, client: _Client, response: Any) -> None:
        self._admission = admission = client.admission
        self._clock = admission.clock
        self._write = client.writer[0]
        self._response = response
        self._forwarded = admission.on_forwarded if admission.ticket.chunks_s is not None \
            else None  # traced only
        self.ended = False
        self.error: BaseException | None = None

    def __call__(self, data: bytes, last: bool) -> None:
        if self.error is not None:
            return
        try:
            sent_s = self._clock()
            full = self._write(data, not last)
            if last:
                yield_cpu()  # the answer is out: what follows is bookkeeping
            self._admission.on_body(data, not last, sent_s)
            if self._forwarded is not None:  # the chunk went at sent_s (counted by on_body)
                self._forwarded(sent_s)
            if full:
                self._response.stop_push()  # the client's buffer is full
            self.ended = last
        except BaseException as exc:  # noqa: BLE001 - raised by the relay after the push
            self.error = exc
            self._response.stop_push()


def _is_event_stream(headers: Headers) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.startswith(b"text/event-stream")
    return False


class _Watch:
    """Cancels the forwarding task when the client leaves while the relay is running."""

    __slots__ = ("admission", "task", "relaying", "client_left", "was_cut")

    def __init__(self, admission: Admitted, task: asyncio.Task) -> None:
        self.admission = admission
        self.task = task
        self.relaying = True
        self.client_left = False
        self.was_cut = False  # by cut_all (the drain deadline)

    def cut(self) -> None:
        if self.relaying and not self.was_cut:
            self.was_cut = True
            self.task.cancel()

    def on_gone(self, gone: asyncio.Future) -> None:
        if self.relaying and not gone.cancelled():
            self.client_left = True
            self.admission.on_disconnect()
            self.task.cancel()


class _Client:
    """The client side of one relay: every message is shown to the admission first (status,
    first token, gaps, usage, end), and the proxy's headers are added to the response head."""

    __slots__ = ("admission", "_admission", "_send", "writer", "started")

    def __init__(self, admission: Admitted, send: Send, writer: BodyWriter | None = None) -> None:
        self.admission = self._admission = admission
        self._send = send
        self.writer = writer
        self.started = False  # the response head went to the client

    async def start(self, status: int, headers: Headers) -> None:
        admission = self._admission
        content_type = b""
        has_request_id = False
        for name, value in headers:
            if name == b"content-type":
                content_type = value
            elif name == REQUEST_ID_HEADER:
                has_request_id = True
        admission.on_start(status, content_type)
        if has_request_id:  # the upstream's echo of the guard's id: the client gets its own
            headers = [h for h in headers if h[0] != REQUEST_ID_HEADER]
        headers = [*headers, (REPLICA_HEADER, admission.replica_id.encode()),
                   (QUEUE_MS_HEADER, f"{admission.queue_ms:.1f}".encode()),
                   *id_headers(admission.client_request_id, admission.request_id),
                   *admission.response_headers]
        filled = admission.filled_max_tokens
        if filled is not None:  # the client sent no max_tokens: say what the replica ran with
            headers.append((MAX_TOKENS_HEADER, str(filled).encode()))
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes, more_body: bool) -> None:
        admission = self._admission
        admission.on_body(chunk, more_body)
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more_body})
        if not more_body:
            yield_cpu()  # the answer is out: what follows is bookkeeping
        if admission.ticket.chunks_s is not None:  # traced only
            admission.on_forwarded()

    async def cut(self) -> None:
        """End this response at the drain deadline (the client may be gone already). A JSON
        answer cut while it was being written gets nothing more: its length is declared, so
        the server closes the connection."""
        ticket = self._admission.ticket
        if ticket.body_complete:
            return
        message = "the proxy is shutting down; the response was cut at its drain deadline"
        with contextlib.suppress(OSError):
            if not self.started:
                await self.reject(Rejection(503, SHUTTING_DOWN, message, should_retry=True))
            elif ticket.is_stream:
                await self.body(sse_error_event(SHUTTING_DOWN, message, ticket.responses), False)

    async def reject(self, rejection: Rejection) -> None:
        """A failure answer made here (502/504) before anything else was sent."""
        body = rejection.body()
        await self.start(rejection.status, rejection.headers(len(body)))
        await self.body(body, False)
