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
    ],
)
def test_a_retry_is_any_counter_past_the_first_attempt(headers, retry):
    assert is_retry_attempt(headers) is retry
