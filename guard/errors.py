"""The guard's exceptions, the whole tree in one place::

    GuardError
      ├─ PricingError(status, reason, message, param)  never servable as sent: 400 / 401 / 404 /
      │    │                                          413, x-should-retry false, costs nothing
      │    └─ BodyTooLarge                            413, raised before the rest is buffered
      ├─ ClientDisconnected                           the client left while its body was read
      └─ StateUnavailable (also a RuntimeError)       a replica answers but publishes no load
           │                                          state (404, not a JSON object)
           └─ StateUnparseable                        its metrics page cannot be read (the
                                                      reason says why): it is learned instead

Configuration errors are plain ``ValueError`` naming the key (raised at construction).
"""

from __future__ import annotations

__all__ = ["BodyTooLarge", "ClientDisconnected", "GuardError", "PricingError", "StateUnavailable",
           "StateUnparseable"]


class GuardError(Exception):
    """Base of every exception the guard raises on purpose."""


class PricingError(GuardError):
    """A request that can never be served as sent (answered with ``status``, never retried)."""

    def __init__(self, status: int, reason: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.param = param


class BodyTooLarge(PricingError):
    def __init__(self, max_bytes: int):
        super().__init__(413, "body_too_large", f"request body exceeds {max_bytes} bytes")


class ClientDisconnected(GuardError):
    """The client disconnected before its request body was complete."""


class StateUnavailable(GuardError, RuntimeError):
    """The replica answered, but it publishes no load state (404, or not a JSON object)."""


class StateUnparseable(StateUnavailable):
    """The replica's load-state page is there but cannot be read (missing gauges, not
    Prometheus text); the guard learns the replica's capacity instead."""
