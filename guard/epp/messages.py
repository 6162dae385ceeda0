"""Envoy's ext_proc messages ↔ plain Python values: the only module that builds or reads them.

Reading: a ``HeaderMap`` becomes a ``dict`` of lower-case names (Envoy sends values as
``raw_value`` bytes; ``value`` is read when that is empty); the subset hint and the served
endpoint come from the request's ``metadata_context`` (``envoy.lb.subset_hint`` /
``envoy.lb``), the subset also from the ``x-gateway-destination-endpoint-subset`` header.

Building: the answers of the endpoint picker protocol (the Gateway API inference
extension's): the request-headers answer that names the endpoint (a header mutation with
``clear_route_cache``, and the same endpoint in ``envoy.lb`` dynamic metadata; with an observer
token, the ``kvguard`` metadata the split config's observer filter and route read), the body
re-emitted as streamed body responses of at most :data:`MAX_CHUNK_BYTES` each, the response
path passed through, and a rejection as an ``ImmediateResponse``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as ext_proc_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from guard.admission.shedding import Rejection
from guard.epp.picker import Route

__all__ = ["DESTINATION_HEADER", "MAX_CHUNK_BYTES", "OBSERVER_NAMESPACE", "SUBSET_HEADER",
           "body_chunks", "headers_of", "immediate", "observer_token", "request_headers_answer",
           "response_body_answer", "response_elsewhere", "response_headers_answer",
           "served_endpoint", "subset_of", "trailers_answer"]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# the split config's dynamic metadata: the observer's token (``ticket``), the deciding EPP
# (``epp``, with several), and the response headers the route adds from it (``replica``,
# ``queue-ms``, ``request-id``)
OBSERVER_NAMESPACE = "kvguard"
TOKEN_KEY = "ticket"
_NO_BODY = ext_proc_mode_pb2.ProcessingMode.NONE
# a streamed body response carries at most this much (the protocol's bound, under gRPC's and
# Envoy's per-message buffers)
MAX_CHUNK_BYTES = 62_000

ProcessingRequest = ext_proc.ProcessingRequest
ProcessingResponse = ext_proc.ProcessingResponse
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(header_map) -> dict[str, str]:
    """A ``HeaderMap`` as lower-case name → value (pseudo-headers such as ``:path`` kept)."""
    headers = {}
    for header in header_map.headers:
        raw = header.raw_value
        headers[header.key.lower()] = raw.decode("latin-1") if raw else header.value
    return headers


def subset_of(message, headers: dict[str, str]) -> list[str] | None:
    """The endpoints Envoy allows (``ip:port``), from the metadata hint or the header; None
    when there is no hint."""
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is not None and SUBSET_HEADER in hint.fields:
        value = hint.fields[SUBSET_HEADER]
        if value.HasField("list_value"):
            return [v.string_value for v in value.list_value.values]
        return _comma_list(value.string_value)
    if SUBSET_HEADER in headers:
        return _comma_list(headers[SUBSET_HEADER])
    return None


def served_endpoint(message) -> str | None:
    """The endpoint Envoy reports it sent the request to, when it reports one."""
    lb = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is None or SERVED_KEY not in lb.fields:
        return None
    return lb.fields[SERVED_KEY].string_value or None


def observer_token(message) -> str | None:
    """The token an observer stream's messages carry (``kvguard``/``ticket`` metadata, set by
    the decision and forwarded by Envoy); None when absent."""
    ours = message.metadata_context.filter_metadata.get(OBSERVER_NAMESPACE)
    if ours is None or TOKEN_KEY not in ours.fields:
        return None
    return ours.fields[TOKEN_KEY].string_value or None


def response_elsewhere(message) -> bool:
    """Whether the stream that ``message`` opens will not carry the response body: Envoy's
    ``protocol_config`` (on a stream's first message) says the response body is not sent
    (the split config's decision filter), so an observer stream reports the response."""
    return (message.HasField("protocol_config")
            and message.protocol_config.response_body_mode == _NO_BODY)


def _comma_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _mutation(headers: Iterable[tuple[str, str]]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name,
                                                              raw_value=value.encode("latin-1")),
                                   append_action=_OVERWRITE)
        for name, value in headers])


def request_headers_answer(route: Route, token: str | None = None,
                           epp_id: str | None = None) -> ProcessingResponse:
    """The request-headers answer: the endpoint (with its fallbacks, comma-separated) as a
    header (route cache cleared) and as ``envoy.lb`` dynamic metadata; the guard's
    ``x-request-id``; ``Content-Length`` when the body changed. ``token``: the observer's
    (:class:`~guard.epp.handoff.Handoffs`), as ``kvguard`` metadata with the response headers'
    values beside it, and ``epp_id`` (when set) for Envoy's routes to send the observer back."""
    destination = route.destination  # the endpoint, then any fallbacks: the same in both
    headers = [(DESTINATION_HEADER, destination)]
    if route.request_id is not None:
        headers.append(("x-request-id", route.request_id))
    if route.content_length is not None:
        headers.append(("content-length", str(route.content_length)))
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    if token is not None:
        ours = {TOKEN_KEY: token, "replica": route.replica_id}
        if route.queue_ms is not None:
            ours["queue-ms"] = f"{route.queue_ms:.1f}"
        if route.request_id is not None:
            ours["request-id"] = route.request_id
        if epp_id is not None:
            ours["epp"] = epp_id
        metadata.update({OBSERVER_NAMESPACE: ours})
    return ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
            header_mutation=_mutation(headers), clear_route_cache=True)),
        dynamic_metadata=metadata)


def body_chunks(body: bytes, end_of_stream: bool = True) -> Iterator[ProcessingResponse]:
    """The request body re-emitted as streamed body responses (≤ :data:`MAX_CHUNK_BYTES`
    each); the last carries ``end_of_stream`` (False when trailers follow)."""
    num_bytes = len(body)
    start = 0
    while True:
        piece = body[start:start + MAX_CHUNK_BYTES]
        start += MAX_CHUNK_BYTES
        last = start >= num_bytes
        yield _body_answer(piece, end_of_stream and last, response=False)
        if last:
            return


def response_headers_answer(added: Iterable[tuple[str, str]]) -> ProcessingResponse:
    return ProcessingResponse(response_headers=ext_proc.HeadersResponse(
        response=ext_proc.CommonResponse(header_mutation=_mutation(added))))


def response_body_answer(chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
    """A response chunk passed on unchanged (in ``FULL_DUPLEX_STREAMED`` every chunk Envoy
    sends must come back for the client to get it)."""
    return _body_answer(chunk, end_of_stream, response=True)


def _body_answer(chunk: bytes, end_of_stream: bool, *, response: bool) -> ProcessingResponse:
    common = ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
        streamed_response=ext_proc.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)))
    if response:
        return ProcessingResponse(response_body=ext_proc.BodyResponse(response=common))
    return ProcessingResponse(request_body=ext_proc.BodyResponse(response=common))


def trailers_answer(response: bool) -> ProcessingResponse:
    if response:
        return ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
    return ProcessingResponse(request_trailers=ext_proc.TrailersResponse())


def immediate(rejection: Rejection) -> ProcessingResponse:
    """A rejection answered by Envoy itself: the status, the OpenAI-style body and the same
    retry headers as ``kvguard proxy`` sends."""
    headers, body = rejection.response()
    # Envoy sets the local reply's content-length itself
    plain = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers
             if name != b"content-length"]
    return ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=rejection.status),
        headers=_mutation(plain), body=body, details=f"kvguard_{rejection.reason}"))
