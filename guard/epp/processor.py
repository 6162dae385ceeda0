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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from guard.admission.shedding import Rejection
from guard.epp import messages
from guard.epp.picker import EndpointPicker, PickerExchange, Route

__all__ = ["ExternalProcessor"]

Responses = list[messages.ProcessingResponse]


class ExternalProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):
    """The ``envoy.service.ext_proc.v3.ExternalProcessor`` service over an
    :class:`~guard.epp.picker.EndpointPicker`."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.num_streams = 0  # open ext_proc streams (requests in flight through Envoy)

    async def Process(self, request_iterator: AsyncIterator, context) -> AsyncIterator:  # noqa: N802 - the gRPC method name
        gone = asyncio.get_running_loop().create_future()
        context.add_done_callback(lambda _: gone.done() or gone.set_result(None))
        stream = _Stream(self.picker.exchange(lambda: gone))
        self.num_streams += 1
        reset = True
        try:
            async for message in request_iterator:
                for response in await stream.answer(message):
                    yield response
                if stream.ended:
                    break
            # Envoy closes the stream cleanly when the client goes away mid-response: a
            # response that never ended is a client that left
            reset = not stream.ended and not stream.response_ended
        finally:
            self.num_streams -= 1
            stream.exchange.close(reset)


class _Stream:
    """One stream's translation state: what has been decided and answered so far."""

    __slots__ = ("exchange", "subset", "decided", "ended", "response_ended")

    def __init__(self, exchange: PickerExchange) -> None:
        self.exchange = exchange
        self.subset: list[str] | None = None
        self.decided = False
        self.ended = False  # answered with an ImmediateResponse (or nothing): the stream is done
        self.response_ended = False

    async def answer(self, message) -> Responses:
        kind = message.WhichOneof("request")
        exchange = self.exchange
        if kind == "request_headers":
            http = message.request_headers
            headers = messages.headers_of(http.headers)
            exchange.on_request_headers(headers)
            self.subset = messages.subset_of(message, headers)
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
        if kind == "response_headers":
            http = message.response_headers
            added = exchange.on_response_headers(messages.headers_of(http.headers),
                                                 messages.served_endpoint(message))
            if http.end_of_stream:
                self._response_end(b"")
            return [messages.response_headers_answer(added)]
        if kind == "response_body":
            body = message.response_body
            if body.end_of_stream:
                self._response_end(body.body)
            else:
                exchange.on_response_body(body.body, False)
            return [messages.response_body_answer(body.body, body.end_of_stream)]
        if kind == "response_trailers":
            self._response_end(b"")
            return [messages.trailers_answer(response=True)]
        return []

    def _response_end(self, chunk: bytes) -> None:
        self.response_ended = True
        self.exchange.on_response_body(chunk, True)

    async def _decide(self, body: str) -> Responses:
        """The decision, answered. ``body``: ``none`` (the request has none), ``whole`` (it
        ended) or ``before_trailers`` (trailers follow it)."""
        self.decided = True
        answer = await self.exchange.decide(self.subset)
        if isinstance(answer, Route):
            answers = [messages.request_headers_answer(answer)]
            if body != "none":
                answers.extend(messages.body_chunks(answer.body, body == "whole"))
            return answers
        self.ended = True
        if isinstance(answer, Rejection):
            return [messages.immediate(answer)]
        return []  # the client left: nothing to answer
