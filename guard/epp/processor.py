"""``ExternalProcessor``: the ext_proc gRPC stream loop, a translator and nothing more.

One gRPC stream is one HTTP request through Envoy (``FULL_DUPLEX_STREAMED`` for both bodies).
Each message Envoy sends becomes a call on the request's
:class:`~guard.epp.picker.PickerExchange`, and what it returns becomes the messages Envoy
expects back, in the order the protocol requires (request headers → request body → request
trailers; then the same for the response):

* request headers: kept; a request without a body (``end_of_stream``) is decided at once;
* request body chunks: collected until the body is complete (or past the byte limit), then
  the decision: a :class:`~guard.epp.picker.Route` answers the headers (the endpoint) and
  re-emits the body; a :class:`~guard.admission.shedding.Rejection` is an
  ``ImmediateResponse`` and ends the stream; None (the client left while queued) ends it
  without an answer;
* response headers and each response body chunk: shown to the exchange (the ticket's first
  token, gaps, usage, end) and passed back at once, unbuffered;
* the stream cut before its end (the client reset, Envoy gone): the exchange is closed as
  ``reset`` and the ticket released ``canceled``.

**Split** (``deploy/envoy/envoy-split.yaml``): when Envoy's ``protocol_config`` says the
stream will not carry the response body, an admitted request's exchange is handed to
:class:`~guard.epp.handoff.Handoffs` and its token goes out with the decision as ``kvguard``
dynamic metadata. A stream whose messages are in observability mode is an observer: it claims
the exchange by the token its metadata carries and feeds the ticket from the response headers
and body, answering nothing (Envoy wants no answers there); it ends its side once the response
ended, and a stream that ends before that (Envoy closes it after the client left, past its
``deferred_close_timeout``) releases the ticket ``canceled``. An observer with no claimable
token ends at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from guard.admission.shedding import Rejection
from guard.epp import messages
from guard.epp.handoff import Handoffs
from guard.epp.picker import EndpointPicker, PickerExchange, Route

__all__ = ["ExternalProcessor"]

Responses = list[messages.ProcessingResponse]


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    """The ``envoy.service.ext_proc.v3.ExternalProcessor`` service over an
    :class:`~guard.epp.picker.EndpointPicker`; ``handoffs``: where decisions whose response
    an observer stream reports wait for it (None: every stream carries its own response)."""

    def __init__(self, picker: EndpointPicker, handoffs: Handoffs | None = None) -> None:
        self.picker = picker
        self.handoffs = handoffs
        self.num_streams = 0  # open ext_proc streams (requests in flight through Envoy)

    async def Process(self, request_iterator: AsyncIterator, context) -> AsyncIterator:  # noqa: N802 - the gRPC method name
        self.num_streams += 1
        incoming = request_iterator.__aiter__()
        try:
            first = await anext(incoming, None)
            if first is None:
                return
            if first.observability_mode:
                await self._observe(first, incoming)
                return
            # closed with this generator, whenever gRPC closes it (the ticket's release runs
            # in the decision's finally)
            async with contextlib.aclosing(self._decision(first, incoming, context)) as answers:
                async for response in answers:
                    yield response
        finally:
            self.num_streams -= 1

    async def _decision(self, first, incoming: AsyncIterator, context) -> AsyncIterator:
        """A request's own stream: decided, answered, and its response when it carries it."""
        gone = asyncio.get_running_loop().create_future()
        context.add_done_callback(lambda _: gone.done() or gone.set_result(None))
        stream = _Stream(self.picker.exchange(lambda: gone), self.handoffs)
        reset = True
        try:
            message = first
            while message is not None:
                for response in await stream.answer(message):
                    yield response
                if stream.ended:
                    break
                message = await anext(incoming, None)
            # Envoy closes the stream cleanly when the client goes away mid-response: a
            # response that never ended is a client that left (handed off: the response is
            # the observer's, and a clean end is this stream's normal one)
            reset = not (stream.ended or stream.response_ended or stream.token)
        finally:
            stream.close(reset)

    async def _observe(self, first, incoming: AsyncIterator) -> None:
        """An observer stream: the response of the request whose token it carries."""
        handoffs = self.handoffs
        exchange = None if handoffs is None else handoffs.claim(messages.observer_token(first))
        if exchange is None:  # not ours to observe (no admission, or a token not ours)
            return
        stream = _Stream(exchange, None)
        try:
            # the first message is the request headers in deploy/envoy/envoy-split.yaml; a
            # config that skips them opens the stream with the response headers
            message = first
            while message is not None:
                stream.observe(message)
                if stream.response_ended:  # done: end the stream, Envoy sends no more
                    break
                message = await anext(incoming, None)
        finally:
            exchange.close(not stream.response_ended)


class _Stream:
    """One stream's translation state: what has been decided and answered so far."""

    __slots__ = ("exchange", "handoffs", "subset", "decided", "ended", "response_ended",
                 "token")

    def __init__(self, exchange: PickerExchange, handoffs: Handoffs | None) -> None:
        self.exchange = exchange
        # set while the request's stream will not carry its response (split): where the
        # exchange goes once admitted
        self.handoffs = handoffs
        self.subset: list[str] | None = None
        self.decided = False
        self.ended = False  # answered with an ImmediateResponse (or nothing): the stream is done
        self.response_ended = False
        self.token: str | None = None  # the exchange was handed off under it

    def close(self, reset: bool) -> None:
        """The stream is over. A handed-off exchange is its observer's whichever way this
        stream ended (Envoy may reset it once the request is through, before or after the
        observer stream arrived; one that never arrives is the wait's to end)."""
        if self.token is None:
            self.exchange.close(reset)

    async def answer(self, message) -> Responses:
        kind = message.WhichOneof("request")
        exchange = self.exchange
        if kind == "request_headers":
            http = message.request_headers
            headers = messages.headers_of(http.headers)
            exchange.on_request_headers(headers)
            self.subset = messages.subset_of(message, headers)
            if self.handoffs is not None and not messages.response_elsewhere(message):
                self.handoffs = None  # this stream carries the response itself
            return await self._decide("none") if http.end_of_stream else []
        if kind == "request_body":
            body = message.request_body
            over_limit = exchange.add_body(body.body)
            if self.decided:  # past the limit already answered
                return []
            if body.end_of_stream or over_limit:
                return await self._decide("whole")
            return []
        if kind == "request_trailers":
            if self.decided:
                return [messages.trailers_answer(response=False)]
            answers = await self._decide("before_trailers")
            return answers if self.ended else [*answers, messages.trailers_answer(response=False)]
        if self.token is not None:  # handed off: the observer feeds the ticket, not this stream
            return _passed_on(message, kind)
        if kind == "response_headers":
            added = self._response_headers(message.response_headers, message)
            return [messages.response_headers_answer(added)]
        if kind == "response_body":
            body = message.response_body
            self._response_body(body)
            return [messages.response_body_answer(body.body, body.end_of_stream)]
        if kind == "response_trailers":
            self._response_end(b"")
            return [messages.trailers_answer(response=True)]
        return []

    def observe(self, message) -> None:
        """An observer stream's message: the response shown to the exchange, nothing answered."""
        kind = message.WhichOneof("request")
        if kind == "response_headers":
            self._response_headers(message.response_headers, message)
        elif kind == "response_body":
            self._response_body(message.response_body)
        elif kind == "response_trailers":
            self._response_end(b"")

    def _response_headers(self, http, message) -> list[tuple[str, str]]:
        added = self.exchange.on_response_headers(messages.headers_of(http.headers),
                                                  messages.served_endpoint(message))
        if http.end_of_stream:
            self._response_end(b"")
        return added

    def _response_body(self, body) -> None:
        if body.end_of_stream:
            self._response_end(body.body)
        else:
            self.exchange.on_response_body(body.body, False)

    def _response_end(self, chunk: bytes) -> None:
        self.response_ended = True
        self.exchange.on_response_body(chunk, True)

    async def _decide(self, body: str) -> Responses:
        """The decision, answered. ``body``: ``none`` (the request has none), ``whole`` (it
        ended) or ``before_trailers`` (trailers follow it)."""
        self.decided = True
        answer = await self.exchange.decide(self.subset)
        if isinstance(answer, Route):
            if self.handoffs is not None and self.exchange.admitted is not None:
                self.token = self.handoffs.hand_off(self.exchange)
            epp_id = None if self.token is None else self.handoffs.epp_id
            answers = [messages.request_headers_answer(answer, self.token, epp_id)]
            if body != "none":
                answers.extend(messages.body_chunks(answer.body, body == "whole"))
            return answers
        self.ended = True
        if isinstance(answer, Rejection):
            return [messages.immediate(answer)]
        return []  # the client left: nothing to answer


def _passed_on(message, kind: str) -> Responses:
    """A response message of a stream whose exchange was handed off, answered unchanged."""
    if kind == "response_headers":
        return [messages.response_headers_answer(())]
    if kind == "response_body":
        body = message.response_body
        return [messages.response_body_answer(body.body, body.end_of_stream)]
    if kind == "response_trailers":
        return [messages.trailers_answer(response=True)]
    return []
