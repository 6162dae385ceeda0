"""``QueueWait``: a request the policy queued, waiting in the admission queue for its decision.

It waits (at most until its ``Queue.until_s``, capped at arrival + ``max_queue_wait_s``) while
the queue pump decides for it, watching for its client to leave. The pump's Admit is confirmed
against other guards' reservations when they are shared, and a request decided Queue again
waits on. A client that leaves (or a task cancelled) while queued is counted canceled, and an
admission it already got is undone as a canceled ticket, so no reservation leaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from guard.admission.decider import Decider
from guard.admission.queue import AdmissionQueue, Waiter
from guard.admission.shedding import Rejecter
from guard.admission.ticket import TicketBook
from guard.observe.metrics import GuardMetrics
from guard.replicas.load_state import LoadState
from policies.cost import RequestCost
from policies.decision import Admit, Queue, Shed
from policies.snapshot import NOTHING_AHEAD

__all__ = ["QueueWait"]

ClientGone = Callable[[], asyncio.Future] | None


class QueueWait:
    """Waiting in ``queue`` for one guard (its decider, metrics, tickets and rejecter)."""

    def __init__(self, queue: AdmissionQueue, decider: Decider, metrics: GuardMetrics,
                 clock: Callable[[], float], tickets: TicketBook, load_state: LoadState,
                 rejecter: Rejecter, max_queue_wait_s: float) -> None:
        self.queue = queue
        self.decider = decider
        self.metrics = metrics
        self.clock = clock
        self.tickets = tickets
        self.load_state = load_state
        self.rejecter = rejecter
        self.max_queue_wait_s = max_queue_wait_s

    async def outcome(self, cost: RequestCost, result: Queue | Shed, client_gone: ClientGone
                      ) -> tuple[Admit | Shed | None, float | None]:
        """Wait while ``result`` is Queue: the final decision (None: the client left, already
        counted canceled) and when the request entered the queue (None: never queued)."""
        enqueue_s = None
        while isinstance(result, Queue):
            enqueue_s = self.clock() if enqueue_s is None else enqueue_s
            until_s = min(result.until_s, cost.arrival_s + self.max_queue_wait_s)
            result = await self._wait(cost, until_s, enqueue_s, client_gone)
            if self.decider.shared is not None and isinstance(result, Admit):
                result = await self.decider.confirmed(cost, result, NOTHING_AHEAD)
        return result, enqueue_s

    async def _wait(self, cost: RequestCost, until_s: float, enqueue_s: float,
                    client_gone: ClientGone) -> Admit | Shed | None:
        """Wait in the queue; None when the client left (nothing reserved is kept)."""
        waiter = self.queue.push(cost, until_s, enqueue_s)
        if isinstance(waiter, Shed):
            return waiter
        self.metrics.counters(cost.request_class.name, cost.tenant).queued.inc()
        gone = client_gone() if client_gone is not None else None
        watched = (waiter.future,) if gone is None else (waiter.future, gone)
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._leave(waiter)
            raise
        self.metrics.histograms(cost.request_class.name).queue_wait.observe(self.clock() - enqueue_s)
        if gone is not None and gone.done():
            self._leave(waiter)
            return None
        return waiter.future.result()

    def _leave(self, waiter: Waiter) -> None:
        """The queued client left (or our task was cancelled): counted canceled, and an
        admission it already got is undone, so nothing leaks."""
        self.queue.remove(waiter)
        future, cost = waiter.future, waiter.cost
        self.decider.forget(cost.request_id)
        if future.done() and not future.cancelled() and isinstance(future.result(), Admit):
            # admitted but never dispatched: released as canceled (frees the reservation)
            ticket = self.tickets.issue(self.load_state.reservation(cost.request_id),
                                        self.clock(), enqueue_s=waiter.enqueued_s)
            ticket.release("canceled")
        else:
            self.rejecter.count_early(cost.request_id, cost.tenant, cost.arrival_s,
                                      cost.request_class.name, "canceled", waiter.enqueued_s)
        future.cancel()
