"""guard.epp.messages: Envoy's ext_proc protobuf messages built and read (real protobuf)."""

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from guard.admission.shedding import Rejection
from guard.epp import messages
from guard.epp.picker import Route


def _set_headers(mutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def test_the_request_headers_answer_names_the_endpoint_twice_and_fixes_content_length():
    answer = messages.request_headers_answer(Route("10.0.0.1:8000", "r0", b"{}", 2, "g-1"))
    common = answer.request_headers.response
    assert common.clear_route_cache
    assert _set_headers(common.header_mutation) == {
        "x-gateway-destination-endpoint": "10.0.0.1:8000", "x-request-id": "g-1",
        "content-length": "2"}
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000"
    plain = messages.request_headers_answer(Route("10.0.0.1:8000", "r0", b"{}"))
    assert set(_set_headers(plain.request_headers.response.header_mutation)) == {
        "x-gateway-destination-endpoint"}


def test_fallback_endpoints_follow_the_endpoint_comma_separated_in_header_and_metadata():
    route = Route("10.0.0.1:8000", "r0", b"{}", fallbacks=("10.0.0.2:8000", "10.0.0.3:8000"))
    answer = messages.request_headers_answer(route)
    listed = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"
    headers = _set_headers(answer.request_headers.response.header_mutation)
    assert headers["x-gateway-destination-endpoint"] == listed
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == listed


def test_the_body_is_re_emitted_in_pieces_of_at_most_62000_bytes():
    body = bytes(range(256)) * 500  # 128,000 bytes
    pieces = list(messages.body_chunks(body))
    streamed = [p.request_body.response.body_mutation.streamed_response for p in pieces]
    assert [len(s.body) for s in streamed] == [62_000, 62_000, 4_000]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    (empty,) = messages.body_chunks(b"")
    assert empty.request_body.response.body_mutation.streamed_response.end_of_stream
    (before_trailers,) = messages.body_chunks(b"x", end_of_stream=False)
    assert not before_trailers.request_body.response.body_mutation.streamed_response.end_of_stream


def test_a_rejection_is_an_immediate_response_with_the_proxys_headers_and_body():
    rejection = Rejection(429, "rpm_limit", "over budget", retry_after_s=2.5, should_retry=True)
    immediate = messages.immediate(rejection).immediate_response
    assert immediate.status.code == 429
    headers = _set_headers(immediate.headers)
    assert headers == {"content-type": "application/json", "x-should-retry": "true",
                       "x-kvguard-reason": "rpm_limit", "retry-after": "3",
                       "retry-after-ms": "2500"}
    assert immediate.body == rejection.body()


def test_response_chunks_pass_through_unchanged():
    answer = messages.response_body_answer(b"data: x\n\n", False)
    streamed = answer.response_body.response.body_mutation.streamed_response
    assert streamed.body == b"data: x\n\n" and not streamed.end_of_stream
    added = messages.response_headers_answer([("x-kvguard-replica", "r1")])
    assert _set_headers(added.response_headers.response.header_mutation) == {
        "x-kvguard-replica": "r1"}


def _request(headers, subset=None, served=None):
    header_map = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=header_map, end_of_stream=False))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


def test_headers_the_subset_hint_and_the_served_endpoint_are_read():
    message = _request({":path": "/v1/completions", "Content-Type": "application/json"},
                       subset=["10.0.0.1:8000", "10.0.0.2:8000"], served="10.0.0.2:8000")
    headers = messages.headers_of(message.request_headers.headers)
    assert headers == {":path": "/v1/completions", "content-type": "application/json"}
    assert messages.subset_of(message, headers) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert messages.served_endpoint(message) == "10.0.0.2:8000"
    plain = _request({"x-gateway-destination-endpoint-subset": "10.0.0.1:8000, 10.0.0.3:8000"})
    plain_headers = messages.headers_of(plain.request_headers.headers)
    assert messages.subset_of(plain, plain_headers) == ["10.0.0.1:8000", "10.0.0.3:8000"]
    assert messages.subset_of(_request({}), {}) is None
    assert messages.served_endpoint(_request({})) is None
