"""Retry counters from the headers clients and proxies send."""

import pytest

from guard.request.retry_headers import is_retry_attempt


@pytest.mark.parametrize(
    ("headers", "retry"),
    [
        ({}, False),
        ({"x-stainless-retry-count": "0"}, False),  # the OpenAI SDK's first attempt
        ({"x-stainless-retry-count": "1"}, True),
        ({"x-envoy-attempt-count": "1"}, False),  # Envoy counts the first attempt as 1
        ({"x-envoy-attempt-count": "2"}, True),
        ({"grpc-previous-rpc-attempts": "1"}, True),
        ({"x-retry-count": "3"}, True),
        ({"x-retry-attempt": "0"}, False),
        ({"x-stainless-retry-count": "soon"}, False),  # not a counter: says nothing
        ({"x-stainless-retry-count": "-1"}, False),
        ({"x-stainless-retry-count": " 2 "}, True),
        ({"x-stainless-retry-count": "0", "x-envoy-attempt-count": "2"}, True),
        # junk says nothing: past Python's 4,300-digit int() limit, past 9 digits, not ASCII
        ({"x-stainless-retry-count": "7" * 5000}, False),
        ({"x-envoy-attempt-count": "9" * 4301}, False),
        ({"x-retry-count": "1234567890"}, False),
        ({"x-retry-count": "123456789"}, True),
        ({"grpc-previous-rpc-attempts": "\u00b2"}, False),  # '²'.isdigit(), int() refuses it
        ({"x-retry-attempt": "\u0663"}, False),  # Arabic-Indic three
        ({"x-retry-count": ""}, False),
    ],
)
def test_a_retry_is_any_counter_past_the_first_attempt(headers, retry):
    assert is_retry_attempt(headers) is retry


@pytest.mark.parametrize("name", ["x-stainless-retry-count", "x-envoy-attempt-count",
                                  "grpc-previous-rpc-attempts", "x-retry-count"])
def test_a_5000_digit_counter_through_the_middleware_is_served_as_a_first_attempt(name):
    import asyncio

    from tests.support.admission import PROMPT, Client, http_scope, make_guard

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def main():
        guard = make_guard(app)
        client = Client(PROMPT)
        await guard(http_scope(headers=[(name.encode(), b"7" * 5000)]), client.receive,
                    client.send)
        assert client.status == 200 and client.body == b"ok"
        await guard.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))
