"""Immutable load state a policy decides against: one snapshot per replica plus the whole view."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING

from policies.replica_load import ReplicaLoad, SeqTotals
from policies.retry_budget import NO_RETRY_OVER_BUDGET, RetryBudgetView
from policies.seq_load import SeqLoad
from policies.step_time import StepTimeModel

if TYPE_CHECKING:  # policies.candidates forecasts on snapshots: imported for the annotation only
    from policies.candidates import RankedFleet

__all__ = ["SeqLoad", "ReplicaSnapshot", "LoadSnapshot", "QueuedAhead", "NOTHING_AHEAD",
           "RESTAMPED_FIELDS"]

# no waiter expected on any one replica
_NOTHING_HELD: Mapping[str, tuple[int, int, int]] = MappingProxyType({})


# the ReplicaSnapshot fields that no sum cached on it reads (ReplicaSnapshot.restamped)
RESTAMPED_FIELDS = frozenset(
    ("observed_s", "healthy", "weight", "concurrency_limit", "first_token_s"))


@dataclass(frozen=True)
class ReplicaSnapshot:
    """A replica's state at ``observed_s`` plus the guard's in-flight reservations.

    ``reserved`` are requests this guard admitted that the replica has not reported yet (closes
    the scrape-lag hole); ``num_reserved_blocks`` are their worst-case blocks.

    ``capacity_known`` is False for a replica that publishes no load state (an arbitrary ASGI
    app or upstream without ``/kvguard/state``): it is healthy but never fresh, so policies
    that predict fall back to their stale-state rule for it.

    ``weight`` is the operator's relative share of traffic for this replica (``[[replicas]]
    weight``, default 1; only ratios matter). Policies read it where they cannot tell replicas
    apart from their state: least-loaded routing compares ``requests ÷ weight``
    (:func:`policies.least_loaded.weighted_load`), and the ``slo`` policy uses that order only
    to break exact ties of its forecast and in its stale-state rule.

    ``concurrency_limit`` is how many requests the guard has learned the replica serves at
    once within its objectives (:mod:`policies.concurrency_limit`), None until one is learned;
    for a replica of unknown capacity it replaces the ``slo`` policy's fixed stale-state cap.
    ``first_token_s`` is a time from dispatch to first token that few of the replica's
    requests exceed (learned alongside from every first token it sent), None until known.
    """

    replica_id: str
    observed_s: float
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    running: tuple[SeqLoad, ...] = ()
    waiting: tuple[SeqLoad, ...] = ()
    reserved: tuple[SeqLoad, ...] = ()
    num_reserved_blocks: int = 0
    num_inflight: int = 0  # requests this guard has admitted and not yet released on it
    healthy: bool = True
    capacity_known: bool = True
    weight: float = 1.0
    concurrency_limit: int | None = None
    first_token_s: float | None = None
    # the replica published its own limits and step times (a kvguard engine); False where
    # they are assumed (a vLLM /metrics scrape, a replica of unknown capacity)
    limits_published: bool = True

    @property
    def num_available_blocks(self) -> int:
        return max(0, self.num_free_blocks - self.num_reserved_blocks)

    @property
    def kv_usage_ratio(self) -> float:
        if self.num_total_blocks <= 0:
            return 1.0
        return 1.0 - self.num_available_blocks / self.num_total_blocks

    @cached_property
    def running_totals(self) -> SeqTotals:
        return SeqTotals.of(self.running, self.block_size, self.max_num_batched_tokens)

    @cached_property
    def waiting_totals(self) -> SeqTotals:
        return SeqTotals.of(self.waiting, self.block_size, self.max_num_batched_tokens)

    @cached_property
    def load(self) -> ReplicaLoad:
        """Sums over this replica's sequences, computed on first use and kept (frozen state)."""
        if self.reserved:
            reserved = SeqTotals.of(self.reserved, self.block_size, self.max_num_batched_tokens)
        else:  # the engine-only snapshot of every state refresh: one shared empty group
            reserved = SeqTotals.empty(self.block_size, self.max_num_batched_tokens)
        return ReplicaLoad.of(self.running_totals, self.waiting_totals, reserved)

    @classmethod
    def assembled(cls, **values: object) -> ReplicaSnapshot:
        """``ReplicaSnapshot(**fields)``, for what builds one on every state refresh of every
        replica: the instance dict filled at once rather than through the frozen
        ``__init__``, one ``object.__setattr__`` per field (more than half of building one).
        Checks what ``__init__`` checks: every field without a default given, no other name."""
        names = values.keys()
        if not _REQUIRED_FIELDS <= names or not names <= _FIELD_DEFAULTS.keys():
            raise TypeError(f"assembled: missing {sorted(_REQUIRED_FIELDS - names)}, "
                            f"unknown {sorted(names - _FIELD_DEFAULTS.keys())}")
        new = object.__new__(cls)
        new.__dict__.update(_FIELD_DEFAULTS)
        new.__dict__.update(values)
        return new

    def restamped(self, **changes: object) -> ReplicaSnapshot:
        """This snapshot with new values for fields that none of its sums reads
        (:data:`RESTAMPED_FIELDS`: when it was observed, its health, weight and learned
        limits), keeping the sums already made — equal to ``dataclasses.replace(self,
        **changes)``, which would build the snapshot anew and drop them (a replica with a
        learned limit re-summed every sequence on every state refresh that way)."""
        unknown = changes.keys() - RESTAMPED_FIELDS
        if unknown:
            raise TypeError(f"restamped: not a field the sums ignore: {sorted(unknown)}")
        new = object.__new__(ReplicaSnapshot)  # as with_reservations: every value validated
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def with_reservations(
        self,
        reserved: tuple[SeqLoad, ...],
        num_reserved_blocks: int,
        num_inflight: int,
        reserved_totals: SeqTotals | None = None,
    ) -> ReplicaSnapshot:
        """This engine state with other guard reservations, keeping the engine groups' sums.

        ``reserved_totals`` (the sums over ``reserved``, when the caller keeps them) lets the
        new snapshot's ``load`` be this one's engine sums plus the reserved group, with no
        re-summing. Called on the guard's hot path, so it copies the instance dict instead of
        going through ``dataclasses.replace`` (every field comes from this validated snapshot).
        """
        new = object.__new__(ReplicaSnapshot)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields.pop("load", None)
        fields["reserved"] = reserved
        fields["num_reserved_blocks"] = num_reserved_blocks
        fields["num_inflight"] = num_inflight
        if reserved_totals is not None and not self.reserved:
            fields["load"] = self.load.with_reserved(reserved_totals)
        return new


# ReplicaSnapshot.assembled's: every field in order, its default (None: required, all of
# which come first and have no default)
_FIELD_DEFAULTS = {f.name: None if f.default is MISSING else f.default
                   for f in fields(ReplicaSnapshot)}
_REQUIRED_FIELDS = frozenset(f.name for f in fields(ReplicaSnapshot) if f.default is MISSING)


@dataclass(frozen=True)
class QueuedAhead:
    """The requests waiting in the guard's admission queue ahead of the one being decided:
    they will take their blocks, slots and prefill before it does.

    ``num_requests``, ``num_prefill_tokens`` and ``num_blocks`` total every waiter. A waiter
    whose prefix some replica holds is expected where the most of it is (the SLO policy's
    cache affinity sends it there), so it delays only the requests forecast on those
    replicas: ``held`` gives, per replica, the (requests, prefill tokens, blocks) of the
    waiters expected there, and ``held_total`` sums those waiters once each. A waiter no
    replica holds any of may go anywhere and counts on every replica. (Counting every waiter
    on every replica forecast a fleet's whole queue on each replica: at 4 replicas it shed
    warm requests whose queue-mates were served within a third of the deadline.)"""

    num_requests: int = 0
    num_prefill_tokens: int = 0
    num_blocks: int = 0
    held: Mapping[str, tuple[int, int, int]] = field(default_factory=lambda: _NOTHING_HELD)
    held_total: tuple[int, int, int] = (0, 0, 0)

    def on(self, replica_id: str) -> tuple[int, int, int]:
        """(requests, prefill tokens, blocks) ahead of a request forecast on ``replica_id``:
        the waiters that may go anywhere and those expected there."""
        n, tokens, blocks = self.held_total
        at = self.held.get(replica_id, (0, 0, 0))
        return (self.num_requests - n + at[0], self.num_prefill_tokens - tokens + at[1],
                self.num_blocks - blocks + at[2])

    def plus(self, num_prefill_tokens: int, num_blocks: int,
             replica_ids: Iterable[str] = (), num_requests: int = 1) -> QueuedAhead:
        """This queue plus ``num_requests`` waiters totalling ``num_prefill_tokens`` and
        ``num_blocks``, expected on ``replica_ids`` (empty: anywhere)."""
        ids = tuple(replica_ids)
        held, held_total = self.held, self.held_total
        if ids:
            grown = dict(held)
            for rid in ids:
                n, tokens, blocks = grown.get(rid, (0, 0, 0))
                grown[rid] = (n + num_requests, tokens + num_prefill_tokens,
                              blocks + num_blocks)
            held = MappingProxyType(grown)
            n, tokens, blocks = held_total
            held_total = (n + num_requests, tokens + num_prefill_tokens, blocks + num_blocks)
        return QueuedAhead(self.num_requests + num_requests,
                           self.num_prefill_tokens + num_prefill_tokens,
                           self.num_blocks + num_blocks, held, held_total)


NOTHING_AHEAD = QueuedAhead()


# Built for every request: slotted, not frozen (a frozen __init__ sets each field through
# object.__setattr__; docs/benchmarks.md §2). Never mutated after construction.
@dataclass(slots=True)
class LoadSnapshot:
    """Everything a policy sees at decision time. ``now_s`` is the guard's clock."""

    now_s: float
    replicas: tuple[ReplicaSnapshot, ...]
    step_time: StepTimeModel
    num_queued: int = 0
    max_staleness_s: float = 2.0
    drain_rate_rps: float = 0.0  # measured completions per second, for Retry-After
    retry_budget: RetryBudgetView = NO_RETRY_OVER_BUDGET  # whose retries are over budget now
    queued_ahead: QueuedAhead = NOTHING_AHEAD  # the guard's queue ahead of this request
    # the fleet ranked for bounded candidate sets (policies.candidates); None: scan every replica.
    # It describes exactly ``replicas``: a caller that narrows ``replicas`` must drop it
    fleet: RankedFleet | None = None

    def fresh_replicas(self) -> tuple[ReplicaSnapshot, ...]:
        now_s, max_staleness_s = self.now_s, self.max_staleness_s
        fresh = []  # a plain loop: a comprehension is one more call on the decision path
        for r in self.replicas:
            if r.healthy and r.capacity_known and now_s - r.observed_s <= max_staleness_s:
                fresh.append(r)
        return tuple(fresh)
