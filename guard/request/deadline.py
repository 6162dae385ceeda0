"""The client's own deadline, read from its request headers (one reading for every use).

Two headers can carry it: the OpenAI SDKs' ``x-stainless-read-timeout`` (seconds; a hint, so a
malformed or non-positive value is ignored) and the guard's own ``deadline_header``
(milliseconds; part of the guard's contract, so a malformed value is a 400). When both are
sent the shorter one holds: the client gives up at the first of them. Pricing turns it into the
request's deadline; retry advice compares the advised wait with what is left of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from guard.errors import PricingError

__all__ = ["SDK_TIMEOUT_HEADER", "client_timeout_s"]

SDK_TIMEOUT_HEADER = "x-stainless-read-timeout"


def client_timeout_s(headers: Mapping[str, str], deadline_header: str) -> float | None:
    """The shortest valid deadline the client sent, in seconds from its arrival; None when it
    sent none. Raises :class:`PricingError` (400 ``invalid_header``) when ``deadline_header``
    is present but not a positive, finite number of milliseconds."""
    timeout_s = None
    sdk = headers.get(SDK_TIMEOUT_HEADER)
    if sdk is not None:
        seconds = _number(sdk)
        if 0 < seconds < math.inf:
            timeout_s = seconds
    own = headers.get(deadline_header)
    if own is not None:
        deadline_ms = _number(own)
        if not 0 < deadline_ms < math.inf:
            raise PricingError(400, "invalid_header", f"{deadline_header} must be a positive "
                               "number of milliseconds", deadline_header)
        own_s = deadline_ms / 1000.0
        timeout_s = own_s if timeout_s is None else min(timeout_s, own_s)
    return timeout_s


def _number(value: str) -> float:
    """``value`` as a float, or NaN (never valid) when it is not a number."""
    try:
        return float(value)
    except ValueError:
        return math.nan
