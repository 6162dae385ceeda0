"""``DirectPath``: an admitted request decided and sent from kvguard's server's read callback.

kvguard's HTTP/1.1 server offers every request whose head and body are in to the app's
``http_direct(request, exchange)`` (``serving.h1_connection``), before any ASGI scope or task
exists. An admitted ``POST`` with a ``content-length`` body is decided right there
(:meth:`~guard.controller.AdmissionController.decide`) and, admitted, written to its replica on
an idle pooled connection (``h1`` client) before the call returns; what is left (the relay, or
the wait and then the relay when the decision must wait) is the coroutine returned, which the
server runs as the request's task. A rejection decided there is written there (True: answered,
no task at all). Everything else (other routes, chunked or oversized bodies) gets None: the
server serves it through ASGI (:meth:`guard.proxy.app.ProxyApp.__call__`), as any other server
would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from guard.admission.admitted import Admitted
from guard.admission.request import AdmissionRequest
from guard.admission.shedding import Rejection
from guard.admission.wait import Wait
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.proxy.exchange import upstream_headers
from guard.proxy.responder import Responder
from guard.proxy.upstream import BodyWriter, Forwarder
from guard.request.body import headers_from_pairs
from guard.request.request_ids import client_request_id
from guard.request.target import Target, read_target

if TYPE_CHECKING:
    from serving.h1_exchange import Exchange
    from serving.h1_head import RequestHead

__all__ = ["DirectPath"]

Message = dict[str, Any]
RawHeaders = list[tuple[bytes, bytes]]
Send = Callable[[Message], Awaitable[None]]


class DirectPath:
    """The read-callback path of one proxy (see the module docstring)."""

    def __init__(self, config: GuardConfig, controller: AdmissionController,
                 forwarder: Forwarder, responder: Responder) -> None:
        self.config = config
        self.controller = controller
        self.forwarder = forwarder
        self.responder = responder
        self._is_admitted = config.is_admitted_path

    def http_direct(self, request: RequestHead, exchange: Exchange) -> Coroutine | bool | None:
        """The request decided (and, admitted, written upstream) now; see the module
        docstring for what each return means."""
        if request.method != "POST" or request.chunked:
            return None
        target = read_target(request.raw_path, request.query_string, self._is_admitted)
        if target.__class__ is not Target or not target.admitted:
            return None  # ASGI answers it (a refused target included)
        if (request.content_length or 0) > self.config.max_body_bytes:
            return None  # the ASGI path answers 413
        body = exchange.take_body()
        if body is None:
            return None
        responder = self.responder
        not_forwarded = responder.not_forwarded
        raw_target, raw_headers, gone = target.raw, request.headers, exchange.gone
        headers = headers_from_pairs(raw_headers)
        if b"authorization" in not_forwarded:
            raw_headers = [h for h in raw_headers if h[0] != b"authorization"]
        client_id = client_request_id(headers.get("x-request-id"))
        result = self.controller.decide(   # priced on the decoded path, sent as the client sent it
            AdmissionRequest(target.path, headers, body, gone))
        writer = (exchange.write_body, exchange.conn.drain)
        if isinstance(result, Admitted):
            responder.annotate(result, client_id)
            try:  # written upstream now, before this returns
                sent = self.forwarder.send_now(result.replica_id, raw_target, raw_headers,
                                               result.body, result.request_id)
            except BaseException as exc:
                result.finish(exc)
                raise
            return self.forwarder.forward(
                result, raw_target,
                upstream_headers(raw_headers, result.request_id, not_forwarded),
                gone(), exchange.send, writer, sent)
        if isinstance(result, Rejection):
            response_headers, response_body = result.response()
            response_headers += responder.rejection_headers(
                result, headers.get("authorization"), client_id)
            exchange.respond(result.status, response_headers, response_body)
            return True
        return self._answer_later(result, raw_target, raw_headers, gone, exchange.send, writer,
                                  client_id, headers.get("authorization"))

    async def _answer_later(self, waiting: Wait, raw_target: str, raw_headers: RawHeaders,
                            client_gone: Callable[[], asyncio.Future], send: Send,
                            writer: BodyWriter, client_id: str | None,
                            authorization: str | None) -> None:
        result = await self.controller.wait(waiting)
        await self.responder.answer(result, raw_target, raw_headers, client_gone, send, writer,
                                    client_id, authorization)
