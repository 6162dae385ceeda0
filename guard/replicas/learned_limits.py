"""Each replica's learned concurrency limit, fed by the guard's ticket releases.

:class:`LearnedLimits` keeps one :class:`policies.concurrency_limit.ConcurrencyLimit` per
replica, turns every released :class:`~guard.admission.ticket.Ticket` into a
:class:`~policies.concurrency_limit.LimitSample` (:func:`signal_of`), and stamps the whole limit
on the replica's snapshots (:meth:`guard.replicas.load_state.LoadState.set_concurrency_limit`),
where the ``slo`` policy reads it for replicas of unknown capacity. It learns for every replica
(the ``kvguard_replica_concurrency_limit`` gauge shows each), whatever its state source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from guard.replicas.load_state import LoadState
from policies.concurrency_limit import GOOD, IGNORED, OVERLOADED, ConcurrencyLimit, LimitSample

__all__ = ["LearnedLimits", "signal_of", "FirstTokenTime", "FIRST_TOKEN_RESTAMP_RATIO"]

# the snapshots carry the estimate again once it moved by this ratio (each new value rebuilds
# them)
FIRST_TOKEN_RESTAMP_RATIO = 0.1


def signal_of(ticket: Any, expects_finish_reason: bool = False) -> str:
    """What an ended request says about its replica's load (see
    :mod:`policies.concurrency_limit`): overload for a failure, a 429, a 5xx, a stream without
    a ``finish_reason`` that stopped short of its ``max_tokens`` (or any stream without one when
    ``expects_finish_reason``: the replica has given one before), or a first token (counted
    from dispatch) or gap past its class limit."""
    outcome = ticket.outcome
    if outcome == "canceled":
        return IGNORED  # the client left: nothing about the replica
    if outcome == "rejected_upstream":
        return OVERLOADED if ticket.status == 429 else IGNORED
    if outcome != "completed" or not ticket.ok:
        return OVERLOADED
    if ticket.is_stream and not ticket.finish_seen and (
            expects_finish_reason or ticket.num_content_chunks < ticket.cost.max_tokens):
        return OVERLOADED  # ended early: the engine dropped or interrupted it
    klass = ticket.cost.request_class
    if ticket.first_token_s is not None and ticket.first_token_s - ticket.dispatch_s > klass.ttft_s:
        return OVERLOADED
    if ticket.max_itl_s is not None and ticket.max_itl_s > klass.itl_s:
        return OVERLOADED
    return GOOD


class FirstTokenTime:
    """A replica's dispatch-to-first-token time as TCP estimates a retransmission timeout
    (RFC 6298): a smoothed mean and mean deviation, and ``upper_s`` = mean + 4 × deviation,
    a time few requests exceed, so a request sent with that much slack meets its deadline."""

    __slots__ = ("mean_s", "deviation_s")

    MEAN_WEIGHT = 0.125
    DEVIATION_WEIGHT = 0.25

    def __init__(self, first_s: float) -> None:
        self.mean_s = first_s
        self.deviation_s = first_s / 2

    def add(self, sample_s: float) -> None:
        self.deviation_s += self.DEVIATION_WEIGHT * (abs(sample_s - self.mean_s)
                                                     - self.deviation_s)
        self.mean_s += self.MEAN_WEIGHT * (sample_s - self.mean_s)

    @property
    def upper_s(self) -> float:
        return self.mean_s + 4.0 * self.deviation_s


class LearnedLimits:
    """``on_released`` is a :class:`~guard.admission.ticket.TicketBook` listener; it must run
    after the one that frees the request's reservation (its in-flight count then excludes
    the request itself)."""

    def __init__(self, load_state: LoadState,
                 make_limit: Callable[[], ConcurrencyLimit] = ConcurrencyLimit) -> None:
        self._load_state = load_state
        self._make_limit = make_limit
        self._limits: dict[str, ConcurrencyLimit] = {}
        # replicas that have ended a stream with a finish_reason: from them, any stream without
        # one was cut short (an app that never sends one is judged only by its length)
        self._finishers: set[str] = set()
        self._first_token: dict[str, FirstTokenTime] = {}  # per replica, good requests only
        self._stamped_s: dict[str, float | None] = {}

    def limit(self, replica_id: str) -> ConcurrencyLimit:
        """The replica's limit (made, at its initial value, on first use)."""
        limit = self._limits.get(replica_id)
        if limit is None:
            limit = self._limits[replica_id] = self._make_limit()
            self._load_state.set_concurrency_limit(replica_id, limit.value)
            self._stamped_s[replica_id] = None
        return limit

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet: what was learned of it goes."""
        for table in (self._limits, self._first_token, self._stamped_s):
            table.pop(replica_id, None)
        self._finishers.discard(replica_id)

    def values(self) -> dict[str, int]:
        return {replica_id: limit.value for replica_id, limit in self._limits.items()}

    def on_released(self, ticket: Any) -> None:
        replica_id = ticket.replica_id
        num_inflight = self._load_state.num_inflight(replica_id) + 1
        if ticket.finish_seen:
            self._finishers.add(replica_id)
        signal = signal_of(ticket, replica_id in self._finishers)
        sample = LimitSample(signal, ticket.dispatch_s, ticket.released_s, num_inflight)
        limit = self.limit(replica_id)
        before = limit.value
        restamp = limit.update(sample) != before
        # every first token the replica sent counts, late ones too (only the good ones would
        # bias the estimate low exactly when the replica slows down)
        if ticket.first_token_s is not None and signal != IGNORED:
            restamp |= self._learn_first_token(replica_id, ticket.first_token_s - ticket.dispatch_s)
        if restamp:
            first_token_s = self.first_token_s(replica_id)
            self._stamped_s[replica_id] = first_token_s
            self._load_state.set_concurrency_limit(replica_id, limit.value, first_token_s)

    def first_token_s(self, replica_id: str) -> float | None:
        """Few of the replica's requests took longer from dispatch to first token
        (:attr:`FirstTokenTime.upper_s`); None before the first."""
        estimate = self._first_token.get(replica_id)
        return None if estimate is None else estimate.upper_s

    def _learn_first_token(self, replica_id: str, sample_s: float) -> bool:
        """Fold one request's first-token time in; True when the snapshots should carry
        the new estimate (the first one, or one that moved by the restamp ratio)."""
        estimate = self._first_token.get(replica_id)
        if estimate is None:
            estimate = self._first_token[replica_id] = FirstTokenTime(sample_s)
        else:
            estimate.add(sample_s)
        new_s = estimate.upper_s
        stamped_s = self._stamped_s.get(replica_id)
        return stamped_s is None or abs(new_s - stamped_s) > FIRST_TOKEN_RESTAMP_RATIO * stamped_s
