"""What an adapter holds for one admitted request: :class:`Admitted`.

The controller returns one from :meth:`~guard.controller.AdmissionController.decide` or
:meth:`~guard.controller.AdmissionController.wait`, with its replica reservation booked and its
ticket issued. The adapter forwards :attr:`Admitted.body` to :attr:`Admitted.replica_id`,
reports what the upstream answered (:meth:`on_start`, :meth:`on_body` per chunk and
:meth:`on_forwarded` once it is sent, :meth:`on_disconnect`) and ends it with
:meth:`finish` exactly once (later calls do nothing). Everything else (metrics, learning, the
budget grant, the trace line, waking the queue) happens in the controller when the ticket is
released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from guard.admission.ticket import Ticket

__all__ = ["Admitted"]


class Admitted:
    """One admitted request: its ticket, the body to forward, the class's ITL histogram."""

    __slots__ = ("ticket", "request_id", "replica_id", "body", "body_rewritten", "clock", "itl",
                 "client_request_id", "response_headers")

    def __init__(self, ticket: Ticket, body: bytes, clock: Callable[[], float], itl: Any) -> None:
        self.ticket = ticket
        self.request_id = ticket.cost.request_id  # sent upstream as x-request-id
        # where its reservation is: set again by AdmissionController.redispatch when it moves
        self.replica_id = ticket.replica_id
        self.body = body  # the request as priced (max_tokens filled in when the client sent none)
        priced = ticket.priced
        # the body differs from what the client sent: send a new content-length
        self.body_rewritten = priced is not None and body is not priced.raw
        self.clock = clock  # the controller's clock
        self.itl = itl  # the class's inter-token gap histogram
        # the client's own sane x-request-id, echoed on the response (set by the adapter)
        self.client_request_id: str | None = None
        self.response_headers: list[tuple[bytes, bytes]] = []  # more, from the adapter

    @property
    def filled_max_tokens(self) -> int | None:
        """The ``max_tokens`` the guard filled in for a client that sent none (None: it sent
        one, or its request went upstream untouched)."""
        priced = self.ticket.priced
        if priced is None or not priced.max_tokens_defaulted:
            return None
        return self.ticket.cost.max_tokens

    @property
    def queue_ms(self) -> float:
        """Arrival → dispatch, for the ``x-kvguard-queue-ms`` response header."""
        ticket = self.ticket
        return (ticket.dispatch_s - ticket.cost.arrival_s) * 1000.0

    def on_start(self, status: int, content_type: bytes) -> None:
        """The upstream's response status and content type (before any body)."""
        self.ticket.on_start(status, content_type)

    def on_body(self, chunk: bytes, more_body: bool, now_s: float | None = None) -> None:
        """One response body chunk as it goes to the client (first token, gaps, usage, end);
        ``now_s``: when it went (default: now)."""
        gap_s = self.ticket.on_body(chunk, more_body, self.clock() if now_s is None else now_s)
        if gap_s is not None:
            self.itl.observe(gap_s)

    def on_forwarded(self, now_s: float | None = None) -> None:
        """The chunk last given to :meth:`on_body` is with the client's transport (recorded
        for the trace, content chunks only, when the ticket keeps ``chunks_s``); ``now_s``:
        when it went (default: now)."""
        chunks = self.ticket.chunks_s
        if chunks is not None and len(chunks) < self.ticket.num_content_chunks:
            chunks.append(self.clock() if now_s is None else now_s)

    def on_disconnect(self) -> None:
        """The client went away (before the end of the response: the request is canceled)."""
        self.ticket.on_disconnect()

    def finish(self, error: BaseException | None = None) -> bool:
        """Release exactly once: the natural outcome when the upstream answered, ``canceled``
        (client gone, or our task cancelled) or ``failed`` when relaying raised ``error``.
        ``False`` when it was already finished."""
        ticket = self.ticket
        if error is None:
            return ticket.release(ticket.natural_outcome())
        gone = ticket.client_disconnected or isinstance(error, asyncio.CancelledError)
        return ticket.release("canceled" if gone else "failed")
