"""``Wait``: a decision that cannot be made at once; :meth:`AdmissionController.wait` makes it.

:meth:`AdmissionController.decide` returns one when the request must wait for something before
it is admitted or rejected: the guard's start-up (the first state refresh), the budget store's
answer, the other guards' confirmation of a shared KV reservation, or a place in the admission
queue. A client that left while its body was being read is a ``Wait`` too (:data:`CLIENT_LEFT`,
already counted canceled), so that every "nothing to send" answer comes from ``wait``.

Every ``Wait`` must be waited for exactly once: what it holds (a budget grant, a reservation
awaiting confirmation) is released by ``wait``, whatever its outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guard.admission.request import AdmissionRequest

__all__ = ["BUDGET", "CLIENT_LEFT", "CONFIRMATION", "QUEUE", "STARTING", "Wait"]

STARTING = "starting"  # the guard's background work and first state refresh
BUDGET = "budget"  # the budget store's answer to the tenant's reservation
CONFIRMATION = "confirmation"  # other guards' view of the replica (shared KV reservations)
QUEUE = "queue"  # the admission queue: admitted, shed, or the client leaves
CLIENT_LEFT = "client_left"  # nothing to wait for: the client left before the decision


class Wait:
    """What ``request`` waits for (``stage``, one of the constants above); ``then()`` is the
    rest of its decision, run once by :meth:`AdmissionController.wait`."""

    __slots__ = ("request", "stage", "then")

    def __init__(self, request: AdmissionRequest, stage: str,
                 then: Callable[[], Awaitable[Any]]) -> None:
        self.request = request
        self.stage = stage
        self.then: Callable[[], Awaitable[Any]] | None = then

    def __repr__(self) -> str:
        return f"Wait({self.stage}, {self.request.path!r})"
