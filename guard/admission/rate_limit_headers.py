"""OpenAI's ``x-ratelimit-*`` response headers for a tenant with a budget.

Every response to a budgeted tenant carries ``x-ratelimit-limit-requests`` and
``x-ratelimit-limit-tokens`` (its per-minute limits, the axes it has). An admitted request's
response adds, when the budget store knows them (``remaining``), ``x-ratelimit-remaining-<axis>``
(what is left after this request, whole units) and ``x-ratelimit-reset-<axis>`` (until the
bucket is full again: it refills linearly over a minute). A 429 from the budget adds, for the
axis that said no, ``x-ratelimit-remaining-<axis>: 0`` and ``x-ratelimit-reset-<axis>``: the
wait until it has room, when the store gave one. Durations are written as OpenAI writes them
(Go's duration format): ``20ms``, ``1.5s``, ``6m0s``.
"""

from __future__ import annotations

import math

from guard.budget.memory_store import REFILL_S
from guard.budget.store import BudgetLimits

__all__ = ["duration_text", "rate_limit_headers"]

_AXIS_OF_REASON = {"rpm_limit": "requests", "tpm_limit": "tokens"}


def duration_text(seconds: float) -> str:
    """``seconds`` (rounded up to the millisecond) as OpenAI's headers write a duration."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-9))
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    text = f"{ms / 1000:g}s"
    return f"{minutes}m{text}" if minutes else text


def rate_limit_headers(limits: BudgetLimits, denied_reason: str | None = None,
                       retry_after_s: float | None = None,
                       remaining: tuple[float | None, float | None] | None = None
                       ) -> list[tuple[bytes, bytes]]:
    """The headers for a tenant with ``limits`` (none for an unlimited one); ``remaining``:
    the store's (tokens, requests) left, for an admitted request."""
    headers = []
    if limits.requests_per_minute is not None:
        headers.append((b"x-ratelimit-limit-requests", b"%d" % limits.requests_per_minute))
    if limits.tokens_per_minute is not None:
        headers.append((b"x-ratelimit-limit-tokens", b"%d" % limits.tokens_per_minute))
    if remaining is not None:
        for axis, left, limit in (("requests", remaining[1], limits.requests_per_minute),
                                  ("tokens", remaining[0], limits.tokens_per_minute)):
            if left is None or limit is None:
                continue
            left = min(float(limit), max(0.0, left))
            headers.append((f"x-ratelimit-remaining-{axis}".encode(), b"%d" % math.floor(left)))
            headers.append((f"x-ratelimit-reset-{axis}".encode(),
                            duration_text((limit - left) * REFILL_S / limit).encode()))
    axis = _AXIS_OF_REASON.get(denied_reason or "")
    if axis is not None:
        headers.append((f"x-ratelimit-remaining-{axis}".encode(), b"0"))
        if retry_after_s is not None:
            headers.append((f"x-ratelimit-reset-{axis}".encode(),
                            duration_text(retry_after_s).encode()))
    return headers
