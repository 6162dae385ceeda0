"""Eager ASGI rejections: 400/401/413 (never servable), 429 (tenant limit), 503 (overload).

Every rejection carries an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}`` and the headers clients and SDKs act on: ``x-should-retry`` and
``x-kvguard-reason`` always; ``Retry-After`` (integer seconds, at least 1) and
``retry-after-ms`` when a retry can help. :class:`RetryAdvisor` derives the wait from the
measured drain rate (requests ahead ÷ completions per second) with seeded jitter, or takes the
policy's own estimate; it is never a constant.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["Rejection", "RetryAdvisor", "send_rejection", "error_type"]

Send = Callable[[dict], Awaitable[None]]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    """The OpenAI-style ``error.type`` for a status."""
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


@dataclass(frozen=True)
class Rejection:
    """One rejection, ready to send. ``retry_after_s`` ``None``: no Retry-After headers."""

    status: int
    reason: str
    message: str
    retry_after_s: float | None = None
    should_retry: bool = False
    param: str | None = None

    def __post_init__(self) -> None:
        if not 400 <= self.status < 600:
            raise ValueError(f"rejection status must be 4xx/5xx, got {self.status}")
        if not self.reason:
            raise ValueError("rejection needs a machine-readable reason")
        if self.retry_after_s is not None and self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")

    def body(self) -> bytes:
        error = {"message": self.message, "type": error_type(self.status),
                 "param": self.param, "code": self.reason}
        return json.dumps({"error": error}).encode()

    def headers(self, body_len: int) -> list[tuple[bytes, bytes]]:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(body_len).encode()),
            (b"x-should-retry", b"true" if self.should_retry else b"false"),
            (b"x-kvguard-reason", self.reason.encode()),
        ]
        if self.retry_after_s is not None:
            seconds = max(1, math.ceil(self.retry_after_s))
            millis = max(1, round(self.retry_after_s * 1000))
            headers.append((b"retry-after", str(seconds).encode()))
            headers.append((b"retry-after-ms", str(millis).encode()))
        return headers


async def send_rejection(send: Send, rejection: Rejection,
                         extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = rejection.body()
    headers = rejection.headers(len(body))
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": rejection.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RetryAdvisor:
    """Retry-After from the drain rate: ``(num_ahead + 1) / drain_rate_rps`` with ±jitter.

    With no measured drain rate yet it falls back to ``fallback_s`` (the caller passes a
    measured service time when it has one). The RNG is injected so tests are exact.
    """

    def __init__(self, rng: random.Random, jitter_ratio: float = 0.2,
                 min_s: float = 0.05, max_s: float = 300.0) -> None:
        if not 0 <= jitter_ratio < 1:
            raise ValueError(f"jitter_ratio must be in [0, 1), got {jitter_ratio}")
        if not 0 < min_s <= max_s:
            raise ValueError("need 0 < min_s <= max_s")
        self._rng = rng
        self.jitter_ratio = jitter_ratio
        self.min_s = min_s
        self.max_s = max_s

    def retry_after_s(self, *, num_ahead: int, drain_rate_rps: float,
                      policy_retry_after_s: float | None = None,
                      expected_free_s: float | None = None, fallback_s: float = 1.0) -> float:
        """The jittered wait before a retry can be served.

        The policy's own estimate wins. Otherwise the larger of two measurements: the drain
        rate's ``(num_ahead + 1) / drain_rate_rps`` and ``expected_free_s``, when a slot is
        expected to free from the in-flight requests' measured service time (completions come
        in bursts when a batch finishes together, and the average rate then understates the
        wait). ``fallback_s`` only when neither is known.
        """
        if policy_retry_after_s is not None:
            base_s = policy_retry_after_s
        else:
            drain_s = (max(0, num_ahead) + 1) / drain_rate_rps if drain_rate_rps > 0 else None
            known = [w for w in (drain_s, expected_free_s) if w is not None]
            base_s = max(known) if known else fallback_s
        jitter = 1.0 + self._rng.uniform(-self.jitter_ratio, self.jitter_ratio)
        return min(self.max_s, max(self.min_s, base_s * jitter))

    @staticmethod
    def should_retry(wait_s: float, client_remaining_s: float | None, can_ever_fit: bool = True) -> bool:
        """``False`` when the request can never fit or the wait outlasts the client's deadline."""
        if not can_ever_fit:
            return False
        return client_remaining_s is None or wait_s <= client_remaining_s
