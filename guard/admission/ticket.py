"""One ticket per admission, released exactly once: stream end, disconnect or error.

A :class:`Ticket` spans the whole upstream response. While the response streams through the
guard the ticket records what the client saw (status, first byte, first content token, the
largest gap between content chunks, whether the stream finished). ``release(outcome)`` runs
the book's listeners (free the load-state reservation, feed the policy a
:class:`~policies.decision.CompletionSample`, update metrics, wake the admission queue) the
first time only; later calls return ``False`` and do nothing.

The ticket holds no copy of the request's reservation: it refers to the one
:class:`~guard.replicas.reservations.Reservation` record the load state keeps (``replica_id``
reads it, so a redispatch that moves the reservation moves the ticket with it), and the
release listener frees that record, once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Literal

from guard.replicas.reservations import Reservation
from policies.decision import CompletionSample

__all__ = ["Ticket", "TicketBook", "Outcome", "OUTCOMES", "ReleaseListener"]

Outcome = Literal["completed", "canceled", "failed", "rejected_upstream"]
OUTCOMES: frozenset[str] = frozenset({"completed", "canceled", "failed", "rejected_upstream"})

_log = logging.getLogger(__name__)
# A non-empty "text" (completions) or "content" (chat) string value: a chunk that carries tokens.
_CONTENT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')
_DONE = b"data: [DONE]"
# The replica ended the sequence itself (shutdown, engine error): never a good completion.
_ABORTED = re.compile(rb'"finish_reason"\s*:\s*"(?:abort|error)"')
# The engine said why the sequence ended (a string, not null): the stream ran to its end.
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_OUTPUT_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# The Responses API (/v1/responses): typed events, no [DONE]. Text arrives in
# response.output_text.delta events; the stream ends with response.completed,
# response.incomplete (max_output_tokens reached: ran to its limit, like finish_reason
# "length") or response.failed; an "error" event means the response did not finish.
_RESPONSE_DELTA = re.compile(rb'"type"\s*:\s*"response\.output_text\.delta"')
_RESPONSE_END = re.compile(rb'"type"\s*:\s*"(response\.(?:completed|incomplete|failed)|error)"')
_INPUT_TOKENS = re.compile(rb'"input_tokens"\s*:\s*(\d+)')
# A whole (non-streamed) Responses body that says it failed: a 200 that is no completion.
_RESPONSE_FAILED = re.compile(rb'"status"\s*:\s*"failed"')
_RESPONSE_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*(\d+)')


class Ticket:
    """An admitted request's permit plus what its response stream looked like."""

    __slots__ = (
        "cost", "reservation", "dispatch_s", "predicted_ttft_s", "status", "is_stream",
        "first_byte_s", "first_token_s", "last_token_s", "max_itl_s", "num_content_chunks",
        "done_seen", "body_complete", "client_disconnected", "outcome", "released_s", "_book",
        "enqueue_s", "priced", "grant", "num_usage_prompt_tokens", "num_usage_output_tokens",
        "ok", "slo_met", "aborted", "chunks_s", "finish_seen", "num_request_bytes",
        "num_response_bytes", "responses",
    )

    def __init__(self, book: TicketBook, reservation: Reservation, dispatch_s: float,
                 predicted_ttft_s: float | None = None, enqueue_s: float | None = None,
                 priced: Any = None, grant: Any = None) -> None:
        self._book = book
        self.reservation = reservation  # the request's in-flight record (replica, cost)
        self.cost = reservation.cost  # the same immutable cost, read on every chunk
        self.dispatch_s = dispatch_s
        self.predicted_ttft_s = predicted_ttft_s
        self.status: int | None = None
        self.is_stream = False
        self.first_byte_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.max_itl_s: float | None = None
        self.num_content_chunks = 0
        self.done_seen = False
        self.body_complete = False
        self.client_disconnected = False
        self.outcome: str | None = None
        self.released_s: float | None = None
        self.enqueue_s = enqueue_s  # when the request entered the admission queue, if it did
        self.priced = priced  # the owner's pricing record, for learning at release
        self.grant = grant  # the budget store's grant, settled or released with the ticket
        self.aborted = False  # the upstream said finish_reason "abort" or "error"
        self.finish_seen = False  # the upstream gave a finish_reason (an interrupted one gives none)
        self.num_request_bytes = 0  # the body sent upstream; with the response's: network cost
        self.num_response_bytes = 0
        self.num_usage_prompt_tokens: int | None = None  # from the upstream's "usage", if seen
        self.num_usage_output_tokens: int | None = None
        self.ok = False  # set at release: completed and the whole response went out
        self.slo_met = False  # set at release: ok and within the class TTFT and ITL
        self.chunks_s: list[float] | None = None  # traced only: each content chunk forwarded
        # a /v1/responses request: its stream is read as typed events (no [DONE])
        self.responses = getattr(priced, "responses", False) is True

    @property
    def request_id(self) -> str:
        return self.cost.request_id

    @property
    def replica_id(self) -> str:
        """The replica its reservation is on (where the request was sent)."""
        return self.reservation.replica_id

    @property
    def released(self) -> bool:
        return self.outcome is not None

    # -- observing the response -------------------------------------------------------------
    def on_start(self, status: int, content_type: bytes) -> None:
        self.status = status
        self.is_stream = content_type.startswith(b"text/event-stream")

    def on_body(self, chunk: bytes, more_body: bool, now_s: float) -> float | None:
        """Record one body chunk; return the inter-token gap it closed (``None`` if none)."""
        if self.first_byte_s is None and chunk:
            self.first_byte_s = now_s
        if not more_body:
            self.body_complete = True
        if not chunk:
            return None
        self.num_response_bytes += len(chunk)
        if self.responses:
            return self._response_events(chunk, now_s)
        # bytes.find, not ``in``: ``sub in chunk`` first tries ``sub`` as an int and formats
        # the TypeError it then discards, several times the cost of the search itself
        if self.is_stream and chunk.find(_DONE) >= 0:
            self.done_seen = True
        if chunk.find(b'"usage"') >= 0:
            self._usage(chunk)
        if not self.finish_seen and chunk.find(b'"finish_reason"') >= 0 \
                and _FINISHED.search(chunk) is not None:
            self.finish_seen = True
        if (chunk.find(b'"abort"') >= 0 or chunk.find(b'"error"') >= 0) \
                and _ABORTED.search(chunk) is not None:
            self.aborted = True
        if self.is_stream and _CONTENT.search(chunk) is None:
            return None
        return self._content_chunk(now_s)

    def _response_events(self, chunk: bytes, now_s: float) -> float | None:
        """A /v1/responses body chunk: usage as input/output tokens; a whole body whose
        ``status`` is ``failed`` is aborted; for a stream, the end
        event (completed or incomplete: finished; failed or error: aborted) and the first
        ``response.output_text.delta`` as the first token."""
        if chunk.find(b'"usage"') >= 0:
            prompt = _INPUT_TOKENS.search(chunk)
            output = _RESPONSE_OUTPUT_TOKENS.search(chunk)
            if prompt is not None:
                self.num_usage_prompt_tokens = int(prompt.group(1))
            if output is not None:
                self.num_usage_output_tokens = int(output.group(1))
        if not self.is_stream:
            if chunk.find(b'"failed"') >= 0 and _RESPONSE_FAILED.search(chunk) is not None:
                self.aborted = True
            return self._content_chunk(now_s)
        if chunk.find(b'"type"') < 0:
            return None
        for end in _RESPONSE_END.finditer(chunk):
            self.done_seen = self.finish_seen = True
            if end.group(1) in (b"response.failed", b"error"):
                self.aborted = True
        if _RESPONSE_DELTA.search(chunk) is None:
            return None
        return self._content_chunk(now_s)

    def _usage(self, chunk: bytes) -> None:
        prompt = _PROMPT_TOKENS.search(chunk)
        output = _OUTPUT_TOKENS.search(chunk)
        if prompt is not None:
            self.num_usage_prompt_tokens = int(prompt.group(1))
        if output is not None:
            self.num_usage_output_tokens = int(output.group(1))

    def _content_chunk(self, now_s: float) -> float | None:
        self.num_content_chunks += 1
        gap_s = None
        if self.first_token_s is None:
            self.first_token_s = now_s
        else:
            gap_s = now_s - self.last_token_s
            if self.max_itl_s is None or gap_s > self.max_itl_s:
                self.max_itl_s = gap_s
        self.last_token_s = now_s
        return gap_s

    # -- judging it -------------------------------------------------------------------------
    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.cost.arrival_s

    def on_disconnect(self) -> None:
        """The client went away; after the last body chunk it no longer matters."""
        if not self.body_complete:
            self.client_disconnected = True

    def finished_ok(self) -> bool:
        """2xx, not aborted by the upstream, and the whole response went out: ``[DONE]`` for a
        stream (a /v1/responses stream: its ``response.completed`` or ``response.incomplete``
        event), the last body chunk otherwise."""
        if self.status is None or not 200 <= self.status < 300 or not self.body_complete:
            return False
        if self.aborted:
            return False
        return self.done_seen if self.is_stream else True

    def natural_outcome(self) -> Outcome:
        """The outcome when the upstream answered: ``canceled`` once the client left before
        the end (whatever the upstream answered afterwards), ``rejected_upstream`` for a 4xx,
        ``completed`` only for a whole, unaborted 2xx response, else ``failed``."""
        if self.client_disconnected:
            return "canceled"
        if self.status is not None and 400 <= self.status < 500:
            return "rejected_upstream"
        return "completed" if self.finished_ok() else "failed"

    def met_slo(self) -> bool:
        """Goodput: completed OK, TTFT within the class limit, every content gap within ITL."""
        if self.outcome != "completed" or not self.finished_ok():
            return False
        return self._within_slo()

    def _within_slo(self) -> bool:
        cost = self.cost
        klass = cost.request_class
        if self.first_token_s is None or self.first_token_s - cost.arrival_s > klass.ttft_s:
            return False  # no first token, or later than the class TTFT
        return self.max_itl_s is None or self.max_itl_s <= klass.itl_s

    @property
    def num_output_tokens(self) -> int:
        """Upstream-reported completion tokens, else the content chunks relayed."""
        if self.num_usage_output_tokens is not None:
            return self.num_usage_output_tokens
        return self.num_content_chunks

    def sample(self) -> CompletionSample:
        """What the policy learns from, built once per request at release."""
        released_s = self.released_s
        assert self.outcome is not None and released_s is not None
        cost = self.cost
        first_token_s = self.first_token_s
        output = self.num_usage_output_tokens
        return CompletionSample(
            cost.request_id, cost.tenant, cost.request_class.name, self.reservation.replica_id,
            released_s, None if first_token_s is None else first_token_s - cost.arrival_s,
            self.max_itl_s, cost.num_prompt_tokens,
            self.num_content_chunks if output is None else output, self.ok, self.slo_met,
            self.outcome, released_s - cost.arrival_s, self.client_disconnected, cost.max_tokens,
            cost.client)

    # -- releasing ------------------------------------------------------------------------
    def release(self, outcome: str) -> bool:
        """Release once; ``False`` (and nothing else) on every later call."""
        if outcome not in OUTCOMES:
            raise ValueError(f"ticket outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}")
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.released_s = self._book.clock()
        self.ok = ok = outcome == "completed" and self.finished_ok()
        self.slo_met = ok and self._within_slo()  # met_slo() without re-checking ok
        self._book._released(self)
        return True

    def __repr__(self) -> str:
        return f"Ticket({self.request_id!r}, replica={self.replica_id!r}, outcome={self.outcome!r})"


ReleaseListener = Callable[[Ticket], None]


class TicketBook:
    """Issues tickets and runs the release listeners (in order) when each is released.

    A listener that raises is logged and skipped; the others still run and the ticket still
    counts as released, so one faulty component never leaks a permit.
    """

    def __init__(self, clock: Callable[[], float], listeners: tuple[ReleaseListener, ...] = ()) -> None:
        self.clock = clock
        self._listeners: list[ReleaseListener] = list(listeners)
        self._held: dict[int, Ticket] = {}

    def add_listener(self, listener: ReleaseListener) -> None:
        self._listeners.append(listener)

    def issue(self, reservation: Reservation, dispatch_s: float,
              predicted_ttft_s: float | None = None, enqueue_s: float | None = None,
              priced: Any = None, grant: Any = None) -> Ticket:
        """A complete ticket for ``reservation``: nothing is written onto it afterwards but
        what the response shows."""
        ticket = Ticket(self, reservation, dispatch_s, predicted_ttft_s, enqueue_s, priced,
                        grant)
        self._held[id(ticket)] = ticket
        return ticket

    @property
    def num_held(self) -> int:
        return len(self._held)

    def held(self) -> tuple[Ticket, ...]:
        return tuple(self._held.values())

    def dispatch_times(self) -> list[float]:
        """Every held ticket's ``dispatch_s``, in no particular order (a new list: one pass,
        no tuple of the tickets on the way; retry advice reads it for every shed)."""
        return [t.dispatch_s for t in self._held.values()]

    def _released(self, ticket: Ticket) -> None:
        self._held.pop(id(ticket), None)
        for listener in self._listeners:
            try:
                listener(ticket)
            except Exception:  # noqa: BLE001 - a listener must never leak the permit
                _log.exception("ticket release listener %r failed for %s", listener, ticket)
