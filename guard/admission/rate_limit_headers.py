"""OpenAI's ``x-ratelimit-*`` response headers for a tenant with a budget.

Every response to a budgeted tenant carries ``x-ratelimit-limit-requests`` and
``x-ratelimit-limit-tokens`` (its per-minute limits, the axes it has). A 429 from the budget
adds, for the axis that said no, ``x-ratelimit-remaining-<axis>: 0`` and
``x-ratelimit-reset-<axis>``: the wait until it has room (``1.5s``), when the store gave one.
The remaining budget of an admitted request is not reported: the budget store answers yes or
no, not how much is left.
"""

from __future__ import annotations

import math

from guard.budget.store import BudgetLimits

__all__ = ["rate_limit_headers"]

_AXIS_OF_REASON = {"rpm_limit": "requests", "tpm_limit": "tokens"}


def rate_limit_headers(limits: BudgetLimits, denied_reason: str | None = None,
                       retry_after_s: float | None = None) -> list[tuple[bytes, bytes]]:
    """The headers for a tenant with ``limits`` (none for an unlimited one)."""
    headers = []
    if limits.requests_per_minute is not None:
        headers.append((b"x-ratelimit-limit-requests", b"%d" % limits.requests_per_minute))
    if limits.tokens_per_minute is not None:
        headers.append((b"x-ratelimit-limit-tokens", b"%d" % limits.tokens_per_minute))
    axis = _AXIS_OF_REASON.get(denied_reason or "")
    if axis is not None:
        headers.append((f"x-ratelimit-remaining-{axis}".encode(), b"0"))
        if retry_after_s is not None:
            seconds = math.ceil(retry_after_s * 1000) / 1000
            headers.append((f"x-ratelimit-reset-{axis}".encode(), f"{seconds:g}s".encode()))
    return headers
