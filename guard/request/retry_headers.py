"""Recognising a retry from the request headers clients and proxies send.

A request is a retry when any of these says so (the value is an attempt counter; a header that
is absent, not a plain ASCII integer of at most ``MAX_COUNT_DIGITS`` digits, or counts a first
attempt says nothing):

| header | sent by | a retry when |
|---|---|---|
| ``x-stainless-retry-count`` | Stainless-generated SDKs (OpenAI, Anthropic Python/TS) | > 0 |
| ``x-envoy-attempt-count`` | Envoy (``include_attempt_count_in_request``) | > 1 (the first attempt is 1) |
| ``grpc-previous-rpc-attempts`` | gRPC transparent and configured retries | > 0 |
| ``x-retry-count``, ``x-retry-attempt`` | common client conventions | > 0 |

A repeated ``Idempotency-Key`` (same tenant, within the key TTL) is the other sign; the pricer
keeps the recent keys.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MAX_COUNT_DIGITS", "RETRY_COUNT_HEADERS", "is_retry_attempt", "retry_count"]

# no client counts its attempts past this; a longer value is junk, read as "not a retry"
# (it also keeps int() clear of Python's 4,300-digit conversion limit)
MAX_COUNT_DIGITS = 9

# (header, the value of a first attempt): a larger value is a retry.
RETRY_COUNT_HEADERS: tuple[tuple[str, int], ...] = (
    ("x-stainless-retry-count", 0),
    ("x-envoy-attempt-count", 1),
    ("grpc-previous-rpc-attempts", 0),
    ("x-retry-count", 0),
    ("x-retry-attempt", 0),
)


def is_retry_attempt(headers: Mapping[str, str]) -> bool:
    """Some retry-counter header (lower-case names) counts past a first attempt."""
    for name, first in RETRY_COUNT_HEADERS:
        value = headers.get(name)
        if value is not None:
            count = retry_count(value)
            if count is not None and count > first:
                return True
    return False


def retry_count(value: str) -> int | None:
    """The attempt counter in one header value, or None when it is not one: empty, longer than
    ``MAX_COUNT_DIGITS``, or anything but ASCII digits (``str.isdigit`` alone also takes
    superscripts and other scripts' digits, which ``int`` refuses)."""
    value = value.strip()
    if not value or len(value) > MAX_COUNT_DIGITS or not (value.isascii() and value.isdigit()):
        return None
    return int(value)
