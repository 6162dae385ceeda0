"""``Decider``: the policy's decisions on fresh load snapshots, and what an admit reserves.

Every decision (a new request, the queue pump's, a redispatch) is the policy's on a snapshot taken
at that moment, behind what already waits in the queue. An admit takes the replica reservation
synchronously, so two decisions can never share the same blocks, and is counted admitted when it
stands. With shared KV reservations (several guards, :mod:`guard.replicas.shared_reservations`)
an admit stands only once it is confirmed against the other guards' reservations: when another
guard reserved on that replica since the decision, the request is decided again on the view that
includes it (at most ``MAX_REDECISIONS`` times; the last decision stands). While draining every
decision is a 503 ``shutting_down``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

from guard.admission.admitted import Admitted
from guard.admission.queue import AdmissionQueue
from guard.admission.retry_budgets import RetryBudgets
from guard.admission.shedding import DrainRate
from guard.observe.metrics import GuardMetrics
from guard.replicas.load_state import LoadState
from guard.replicas.shared_reservations import SharedReservations
from policies.cost import RequestCost
from policies.decision import Admit, Queue, Shed
from policies.shed_reasons import SHUTTING_DOWN
from policies.snapshot import NOTHING_AHEAD, LoadSnapshot, QueuedAhead

__all__ = ["Decider", "MAX_REDECISIONS"]

MAX_REDECISIONS = 4  # shared KV reservations: decisions per request before the last one stands
_DRAINING = Shed(503, SHUTTING_DOWN, retry_after_s=1.0)  # a floor: another replica can serve it


class Decider:
    """Decisions for one guard, over its policy, load state, queue and (optional) shared view."""

    def __init__(self, policy: Any, load_state: LoadState, queue: AdmissionQueue,
                 drain_rate: DrainRate, retry_budgets: RetryBudgets, metrics: GuardMetrics,
                 clock: Callable[[], float], shared: SharedReservations | None) -> None:
        self.policy = policy
        self.load_state = load_state
        self.queue = queue
        self.drain_rate = drain_rate
        self.retry_budgets = retry_budgets  # per model: a request sees its model's
        self.metrics = metrics
        self.clock = clock
        self.shared = shared  # other guards' pending reservations, via Redis
        self.draining = False  # every decision sheds shutting_down
        # the last model group found to hold every replica of the snapshot, and how many
        # replicas that snapshot had: a request of a model every replica serves is decided on
        # the whole snapshot (its ranked fleet kept), checked again only when either changes
        self._whole_group: tuple[frozenset[str] | None, int] = (None, -1)
        self._decided_versions: dict[str, int] = {}  # request id -> shared view it was admitted on

    def decide(self, cost: RequestCost, now_s: float,
               ahead: QueuedAhead = NOTHING_AHEAD) -> Admit | Queue | Shed:
        """Decide on a fresh snapshot (behind ``ahead``, what waits in the queue before it). An
        admit takes its replica reservation at once; it is counted admitted at once too, unless
        reservations are shared (then :meth:`confirmed` counts it, once it stands)."""
        decision = self._decision(cost, now_s, ahead)
        if isinstance(decision, Admit):
            self.load_state.reserve(decision.replica_id, cost.request_id, cost, now_s)
            if self.shared is None:
                self._count_admitted(cost, decision, now_s)
            else:  # the view it was decided on, for the confirmation
                self._decided_versions[cost.request_id] = self.shared.version.get(
                    decision.replica_id, 0)
        return decision

    def decide_arrival(self, cost: RequestCost,
                       now_s: float) -> tuple[Admit | Queue | Shed, QueuedAhead]:
        """A newcomer's decision, behind the waiters queued ahead of it (its rank or a better
        one), and what it was decided behind. It never takes capacity a waiter ahead could
        have: when it would be admitted while such waiters are queued, they decide first on
        that capacity (the queue's pump, now), then it is decided behind those still waiting.
        (Without this, a newcomer decided between a state refresh and the pump's next run took
        the seat a refresh had just shown free, and the waiter it passed was shed at the next
        decision: the slowest sheds of a flood were such waiters.)"""
        ahead = self.queue.ahead_of(cost)
        if not ahead.num_requests:
            return self.decide(cost, now_s, ahead), ahead
        decision = self._decision(cost, now_s, ahead)  # nothing taken yet
        if not isinstance(decision, Admit):
            return decision, ahead
        self.queue.pump(self.decide, now_s)
        ahead = self.queue.ahead_of(cost)
        return self.decide(cost, now_s, ahead), ahead

    def _decision(self, cost: RequestCost, now_s: float, ahead: QueuedAhead) -> Admit | Queue | Shed:
        """The policy's decision on a snapshot taken now; nothing reserved."""
        if self.draining:
            return _DRAINING
        snapshot = self.load_state.snapshot(now_s, len(self.queue), self.drain_rate.rate_rps(now_s),
                                            self.retry_budgets.of(cost).view(now_s), ahead)
        group = cost.replica_ids
        if group is not None and not self._is_whole(group, snapshot):
            snapshot = _among(snapshot, group)  # only the replicas serving its model
        return self.policy.decide(cost, snapshot)

    def _is_whole(self, group: frozenset[str], snapshot: LoadSnapshot) -> bool:
        """Whether ``group`` holds every replica of ``snapshot``: then narrowing to it would
        only drop the ranked fleet, and send the policy to scan every replica."""
        replicas = snapshot.replicas
        whole, num_replicas = self._whole_group
        if group is whole and len(replicas) == num_replicas:
            return True
        if len(group) < len(replicas) or any(r.replica_id not in group for r in replicas):
            return False
        self._whole_group = (group, len(replicas))
        return True

    def _count_admitted(self, cost: RequestCost, admit: Admit, now_s: float) -> None:
        """An admit that stands: the policy told, the admitted counter counted."""
        self.policy.admitted(cost, admit.replica_id, now_s)
        self.load_state.admitted(admit.replica_id, cost)
        self.metrics.counters(cost.request_class.name, cost.tenant).admitted.value += 1

    async def confirmed(self, cost: RequestCost, result: Admit | Queue | Shed,
                        ahead: QueuedAhead) -> Admit | Queue | Shed:
        """Shared KV reservations: publish the reservation and, when another guard reserved on
        that replica since the decision, decide again on the view that includes it."""
        for _ in range(MAX_REDECISIONS):
            version = self._decided_versions.pop(cost.request_id, None)
            if not isinstance(result, Admit):
                return result
            if version is None:  # not decided here since (cannot happen): the view now
                version = self.shared.version.get(result.replica_id, 0)
            try:
                confirmed = await self.shared.confirm(result.replica_id, version)
            except BaseException:  # cancelled (the client left): nothing stays reserved
                self.load_state.release(cost.request_id)
                raise
            if confirmed:
                break
            self.load_state.release(cost.request_id)
            if self.shared.redecided is not None:
                self.shared.redecided.inc()
            result = self.decide(cost, self.clock(), ahead)
        if isinstance(result, Admit):
            self._count_admitted(cost, result, self.clock())
        return result

    def forget(self, request_id: str) -> None:
        """The request left before its confirmation: drop the view it was decided on."""
        self._decided_versions.pop(request_id, None)

    def redispatch(self, admission: Admitted, replica_ids: Collection[str]) -> str | None:
        """Re-decide an admitted request whose replica failed before answering among
        ``replica_ids``: the new replica id (its reservation moved there), or None."""
        cost = admission.ticket.cost
        now_s = self.clock()
        snapshot = self.load_state.snapshot(now_s, len(self.queue), self.drain_rate.rate_rps(now_s),
                                            self.retry_budgets.of(cost).view(now_s))
        allowed = cost.replica_ids
        others = tuple(r for r in snapshot.replicas if r.replica_id in replica_ids
                       and (allowed is None or r.replica_id in allowed))
        # the ranked fleet describes every replica: a narrowed snapshot is decided by scanning
        decision = self.policy.decide(cost, dataclasses.replace(snapshot, replicas=others,
                                                                fleet=None))
        if not isinstance(decision, Admit) or not self.load_state.move(
                cost.request_id, decision.replica_id, now_s):
            return None
        self.policy.admitted(cost, decision.replica_id, now_s)
        return decision.replica_id


def _among(snapshot: LoadSnapshot, replica_ids: frozenset[str]) -> LoadSnapshot:
    """The snapshot with only ``replica_ids``' replicas. Its ranked ``fleet`` would name the
    others: it is dropped, and the policy decides by scanning the replicas left, as for a
    redispatch."""
    return dataclasses.replace(snapshot, fleet=None, replicas=tuple(
        r for r in snapshot.replicas if r.replica_id in replica_ids))
