"""Per-replica load state, the guard's in-flight reservations, and the snapshot policies read.

:class:`LoadState` turns each replica's ``/kvguard/state`` JSON (or, for black-box vLLM
upstreams, its Prometheus ``/metrics`` text) into an immutable
:class:`policies.snapshot.ReplicaSnapshot`, feeds the replica's iteration records to its
:class:`policies.step_time_fitter.StepTimeFitter` (or takes the fit a streamed replica made of
itself: :mod:`serving.step_time_fit`), and adds the requests this guard admitted that the
replica has not reported yet (reservations). ``snapshot(now_s)`` is the whole
:class:`~policies.snapshot.LoadSnapshot`.

Reservations end early when the replica's state lists the request id (the guard forwards its id as
``x-request-id``); for ``vllm`` replicas, whose metrics carry no ids, a reservation ends once a
scrape that started after it was made has been applied (the request is counted there).

Other guards in front of the same replicas publish their pending reservations through Redis
(:mod:`guard.replicas.shared_reservations`); :meth:`LoadState.set_foreign` adds them to the
replica's pending group (they count in its blocks and prefill, not in this guard's in-flight
count), and they end exactly as this guard's own do: when the replica lists the request id, or
(vLLM) once a scrape that started after this guard first saw them has been applied — or when
their guard withdraws them. ``pending_listener`` hears when one of this guard's own
reservations starts or stops being pending (to publish it).

The per-request path is incremental: a reserve or release adds or removes one reservation's
contribution (:class:`guard.replicas.reservations.ReplicaReservations`), and the replica's snapshot
(engine state + reservations) is rebuilt lazily, only when a policy asks for it, from the
engine-side sums computed once per state refresh plus the reserved group's running sums. With
no reservation in flight the combined snapshot is the engine snapshot itself.

A replica that publishes no load state (``/kvguard/state`` answers 404 or non-JSON: any ASGI
app) is registered by :meth:`LoadState.mark_unknown_capacity` as healthy with unknown capacity.

Building a replica's own snapshot from each kind of document is :mod:`guard.replicas.documents`'s;
the poller and its sources live in :mod:`guard.replicas.poller`, the vLLM ``/metrics`` parser in
:mod:`guard.replicas.vllm_metrics` (re-exported here, with the ``UNKNOWN_*`` constants).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from guard.replicas.documents import (
    UNKNOWN_MAX_MODEL_LEN,
    UNKNOWN_NUM_BLOCKS,
    engine_snapshot,
    kvguard_snapshot,
    listed_request_ids,
    unknown_capacity_snapshot,
    vllm_snapshot,
)
from guard.replicas.engine_metrics import EngineLoad
from guard.replicas.fleet_ranking import FleetRanking
from guard.replicas.mean_step_time import MeanStepTime
from guard.replicas.prefix_cache import PrefixCacheView
from guard.replicas.reservations import ReplicaReservations, Reservation
from guard.replicas.vllm_metrics import parse_vllm_metrics, served_model_name
from policies.candidates import MIN_RANKED_REPLICAS
from policies.cost import RequestCost
from policies.retry_budget import NO_RETRY_OVER_BUDGET, RetryBudgetView
from policies.snapshot import NOTHING_AHEAD, LoadSnapshot, QueuedAhead, ReplicaSnapshot
from policies.step_time import StepTimeModel
from policies.step_time_fitter import (
    StepTimeFitter,
    new_records,
    prior_from_timing_model,
    replica_fitter,
    roofline_prior,
)
from serving.step_time_fit import fitted_model

__all__ = [
    "LoadState",
    "PendingListener",
    "UNKNOWN_MAX_MODEL_LEN",
    "UNKNOWN_NUM_BLOCKS",
    "parse_vllm_metrics",
]


FOREIGN_PREFIX = "f:"  # book keys of other guards' reservations


class PendingListener(Protocol):
    def pending_added(self, replica_id: str, request_id: str, cost: RequestCost) -> None: ...

    def pending_ended(self, replica_id: str, request_id: str) -> None: ...


@dataclass
class _Replica:
    fitter: StepTimeFitter
    # the fitter's model after the last update (refits happen off the hot path), or the one
    # the replica published of itself (``fit``: its ``step_time_fit``, as last read)
    model: StepTimeModel
    base: ReplicaSnapshot | None = None  # the replica's own state, without reservations
    last_batch_id: int = -1
    last_step_count: int = -1
    num_preemptions: int | None = None  # the replica's counter at the last refresh
    served_model: str | None = None  # the model name its state document gives
    previous_observed_s: float = float("-inf")
    combined: ReplicaSnapshot | None = None  # base + reservations, rebuilt lazily when dirty
    concurrency_limit: int | None = None  # learned by the guard, stamped on every base
    first_token_s: float | None = None  # learned with it: dispatch -> first token when good
    fit: Any = None


# the columns of a streamed replica's iteration records the fitter reads, in its order
_ITERATION_FIELDS = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens",
                     "duration_s")


class LoadState:
    """Mutable load state of all replicas; every read returns immutable snapshots.

    Not thread-safe: use it from one event loop. The snapshot's ``step_time`` is the
    coefficient-wise mean of the fitted models of the healthy replicas (the default prior when none
    is healthy); :meth:`step_time_model` gives one replica's.
    """

    def __init__(self, max_staleness_s: float = 2.0,
                 fitter_factory: Callable[[StepTimeModel], StepTimeFitter] = replica_fitter,
                 default_prior: StepTimeModel | None = None,
                 weights: Mapping[str, float] | None = None):
        if max_staleness_s <= 0:
            raise ValueError("max_staleness_s: must be > 0")
        self._max_staleness_s = max_staleness_s
        # each replica's configured weight (``[[replicas]] weight``), stamped on its snapshots
        self._weights = dict(weights or {})
        for replica_id, weight in self._weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                    or not math.isfinite(weight) or not weight > 0:
                raise ValueError(f"weights[{replica_id!r}]: must be a finite number > 0, "
                                 f"got {weight!r}")
        self._fitter_factory = fitter_factory
        self._default_prior = default_prior or roofline_prior()
        self._replicas: dict[str, _Replica] = {}
        self._reservations: dict[str, Reservation] = {}
        self._books: dict[str, ReplicaReservations] = {}  # per replica id, made on first reserve
        self._step_time: StepTimeModel | None = None  # the mean model, reset on every update
        self._snapshots: tuple[ReplicaSnapshot, ...] | None = None  # every replica's, until dirty
        # the same snapshots by id, in the fleet's order; the ids changed since they were built
        self._views_by_id: dict[str, ReplicaSnapshot] = {}
        self._changed_ids: set[str] = set()
        self._joined = False  # a replica got its first view since the fleet's order was made
        self._ranking = FleetRanking()  # the fleet in rank order, for bounded candidate sets
        self._mean_step_time = MeanStepTime()  # kept as replicas refresh (used at fleet scale)
        # called with (replica id, new preemptions) when a replica's counter rises
        self.on_preemptions: Callable[[str, int], None] | None = None
        self.pending_listener: PendingListener | None = None  # own pending reservations
        self._foreign: dict[str, dict[str, Reservation]] = {}  # replica -> entry -> reservation
        # the guard's prefix-cache view (guard.replicas.prefix_cache), told of every state,
        # lost replica and admission
        self.cache_view: PrefixCacheView | None = None
        self._left: set[str] = set()  # replicas leaving the fleet (kept unhealthy)

    # --- replica state -----------------------------------------------------------------------

    def _replica(self, replica_id: str, prior: StepTimeModel | None = None) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            fitter = self._fitter_factory(prior or self._default_prior)
            replica = _Replica(fitter, fitter.model())
            self._replicas[replica_id] = replica
        return replica

    def _book(self, replica_id: str) -> ReplicaReservations:
        book = self._books.get(replica_id)
        if book is None:
            book = self._books[replica_id] = ReplicaReservations()
        return book

    # --- fleet membership (a running proxy's replicas change: guard.replicas.discovery) -------

    def set_weight(self, replica_id: str, weight: float) -> None:
        """The weight a replica joining the fleet was configured with."""
        self._weights[replica_id] = weight

    def leave(self, replica_id: str, now_s: float) -> None:
        """``replica_id`` is leaving the fleet: unhealthy from now on (no policy picks it),
        whatever state still arrives for it; its reservations end as their requests do."""
        self._left.add(replica_id)
        replica = self._replicas.get(replica_id)
        if replica is not None and replica.base is not None and replica.base.healthy:
            self._set_base(replica, replica.base.restamped(healthy=False))
        if self.cache_view is not None:
            self.cache_view.forget(replica_id)

    def forget(self, replica_id: str) -> None:
        """A replica that left (:meth:`leave`) and holds no reservation any more: its state,
        step-time fit, rank and books are dropped. ValueError while it still holds one."""
        if self.holds_reservations(replica_id):
            raise ValueError(f"replica {replica_id!r} still holds reservations")
        self._replicas.pop(replica_id, None)
        self._books.pop(replica_id, None)
        self._foreign.pop(replica_id, None)
        self._weights.pop(replica_id, None)
        self._left.discard(replica_id)
        self._changed_ids.discard(replica_id)
        self._ranking.remove(replica_id)
        self._mean_step_time.count(replica_id, None)
        if self._views_by_id.pop(replica_id, None) is not None:
            self._ranking.set_order(self._views_by_id)
        if self.cache_view is not None:
            self.cache_view.forget(replica_id)
        self._snapshots = None
        self._step_time = None

    def holds_reservations(self, replica_id: str) -> bool:
        """True while a request this guard admitted to ``replica_id`` is still in flight."""
        book = self._books.get(replica_id)
        return book is not None and bool(book.num_inflight or any(
            not key.startswith(FOREIGN_PREFIX) for key in book.pending))

    def update_from_kvguard_state(self, replica_id: str, state: Mapping[str, Any],
                                  now_s: float) -> ReplicaSnapshot:
        """Apply one ``/kvguard/state`` document received at ``now_s`` (guard clock)."""
        replica = self._replicas.get(replica_id)
        # the replica's fit of itself (a stream's ``step_time_fit``): checked before anything
        # changes, and only when it is new (a stream hands on the same object until a refit)
        fit = state.get("step_time_fit")
        fitted = None if fit is None or (replica is not None and fit is replica.fit) \
            else fitted_model(fit)
        if replica is None:  # the document's prior seeds the fitter of a replica new to it
            replica = self._replica(replica_id, prior_from_timing_model(
                state.get("timing_model"), state.get("time_scale", 1.0)))
        model = state.get("model")
        replica.served_model = model if isinstance(model, str) else None
        listed = listed_request_ids(state)
        base = kvguard_snapshot(replica_id, state, now_s, self._our_cost, self._reservations)
        if self.cache_view is not None:
            self.cache_view.replica_state(replica_id, state)
        if fit is None:
            self._feed_iterations(replica, state)
        else:  # the replica fitted its samples itself (its own ones are not read here)
            replica.last_step_count = int(state.get("step_count", -1))
            if fitted is not None:
                replica.model, replica.fit = fitted, fit
        self._count_preemptions(replica_id, replica, state.get("num_preemptions"))
        book = self._books.get(replica_id)
        if book is not None:
            for request_id, reservation in list(book.pending.items()):
                if reservation.cost.request_id in listed:
                    self._mark_reported(replica_id, book, request_id)
        return self._set_base(replica, base)

    def touch(self, replica_id: str, now_s: float) -> None:
        """The replica's state is known unchanged at ``now_s`` (a streamed replica that only
        said it is alive): the same view, observed now (and healthy, as after any good
        refresh)."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.base is None:
            return
        self._set_base(replica, replica.base.restamped(observed_s=now_s, healthy=True))

    def _mark_reported(self, replica_id: str, book: ReplicaReservations, key: str) -> None:
        book.mark_reported(key)
        if self.pending_listener is not None and not key.startswith(FOREIGN_PREFIX):
            self.pending_listener.pending_ended(replica_id, key)

    def _our_cost(self, request_id: str) -> RequestCost | None:
        reservation = self._reservations.get(request_id)
        return reservation.cost if reservation is not None else None

    def _count_preemptions(self, replica_id: str, replica: _Replica, counter: Any) -> None:
        """Report a rise of the replica's preemption counter (a restart resets the baseline)."""
        if not isinstance(counter, int) or isinstance(counter, bool):
            return
        previous, replica.num_preemptions = replica.num_preemptions, counter
        if previous is not None and counter > previous and self.on_preemptions is not None:
            self.on_preemptions(replica_id, counter - previous)

    def _feed_iterations(self, replica: _Replica, state: Mapping[str, Any]) -> None:
        """The document's iteration records the replica had not reported before (batch ids
        rise; a restart starts them over) to its fitter, all or none; then its model."""
        step_count = int(state.get("step_count", -1))
        last_batch_id = replica.last_batch_id
        if 0 <= step_count < replica.last_step_count:  # the engine restarted: ids start over
            last_batch_id = -1
        iterations = state.get("iterations") or ()
        if isinstance(iterations, Mapping):  # columns (a stream's form): no Python per record
            last_batch_id = self._feed_iteration_columns(replica.fitter, iterations,
                                                         last_batch_id)
        else:
            records, last_batch_id = new_records(iterations, last_batch_id)
            replica.fitter.add_many(records)
        replica.last_step_count, replica.last_batch_id = step_count, last_batch_id
        replica.model = replica.fitter.model()

    @staticmethod
    def _feed_iteration_columns(fitter: StepTimeFitter, columns: Mapping[str, Any],
                                last_batch_id: int) -> int:
        """Iteration records as columns (one list per field, :mod:`serving.state_delta`) to
        ``fitter``: those whose batch id is above ``last_batch_id``, all or none (KeyError
        for a missing column, ValueError for columns of unequal length or not numbers: the
        poller counts either as the replica's error). Returns the last
        batch id now. A replica's batch ids rise, so the new records are the ones after the
        last id it had reported: found by bisection, the rest handed over as list slices."""
        batch_ids = columns["batch_id"]
        selected = [columns[name] for name in _ITERATION_FIELDS]
        if any(len(column) != len(batch_ids) for column in selected):
            raise ValueError("iteration columns: every list must be as long as batch_id")
        if not batch_ids:
            return last_batch_id
        if not isinstance(batch_ids[-1], int):
            raise ValueError("iteration columns: batch ids must be integers")
        if batch_ids[-1] <= last_batch_id:
            return last_batch_id
        start = bisect.bisect_right(batch_ids, last_batch_id)
        fitter.add_columns(*(column[start:] for column in selected))
        return batch_ids[-1]

    def update_from_vllm_metrics(self, replica_id: str, text: str, now_s: float, *,
                                 max_model_len: int | None = None, max_num_seqs: int = 256,
                                 max_num_batched_tokens: int = 8192,
                                 assumed_output_tokens: int = 128,
                                 assumed_prompt_tokens: int = 512) -> ReplicaSnapshot:
        """Apply one vLLM ``/metrics`` scrape (black-box upstream: counts, no request ids).

        Running requests share the used KV evenly; unknown lengths use the ``assumed_*`` values.
        Limits missing from the metrics' ``*_info`` labels come from the keyword arguments; an
        unknown ``max_model_len`` becomes ``UNKNOWN_MAX_MODEL_LEN`` (no guard-side context check:
        the upstream answers an overflow itself).
        """
        base = vllm_snapshot(replica_id, text, now_s, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             assumed_output_tokens=assumed_output_tokens,
                             assumed_prompt_tokens=assumed_prompt_tokens)
        if self.cache_view is not None:
            self.cache_view.replica_metrics(replica_id, parse_vllm_metrics(text),
                                            served_model_name(text))
        return self._set_counted_base(replica_id, base, now_s)

    def update_from_engine_metrics(self, replica_id: str, load: EngineLoad, now_s: float, *,
                                   max_model_len: int | None = None, max_num_seqs: int = 256,
                                   max_num_batched_tokens: int = 8192,
                                   assumed_output_tokens: int = 128,
                                   assumed_prompt_tokens: int = 512) -> ReplicaSnapshot:
        """Apply one SGLang / TGI / llama.cpp ``/metrics`` scrape, parsed
        (:func:`guard.replicas.engine_metrics.parse_engine_metrics`): counts, no request ids,
        so reservations end as for vLLM (:meth:`update_from_vllm_metrics`)."""
        base = engine_snapshot(replica_id, load, now_s, max_model_len=max_model_len,
                               max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               assumed_output_tokens=assumed_output_tokens,
                               assumed_prompt_tokens=assumed_prompt_tokens)
        return self._set_counted_base(replica_id, base, now_s)

    def _set_counted_base(self, replica_id: str, base: ReplicaSnapshot,
                          now_s: float) -> ReplicaSnapshot:
        """A metrics scrape (no request ids): a pending reservation ends once a scrape that
        started after it was made has been applied (the request is counted there)."""
        replica = self._replica(replica_id)
        book = self._books.get(replica_id)
        if book is not None:
            for request_id, reservation in list(book.pending.items()):
                if reservation.reserved_s <= replica.previous_observed_s:
                    self._mark_reported(replica_id, book, request_id)
        replica.previous_observed_s = now_s
        return self._set_base(replica, base)

    def mark_unknown_capacity(self, replica_id: str, now_s: float) -> ReplicaSnapshot:
        """The replica answers but publishes no load state (``/kvguard/state`` 404 or not JSON).

        It becomes healthy with unknown capacity (``capacity_known=False``: never fresh, so the
        ``slo`` policy's stale-state rule bounds what it admits there). Its reservations stay
        pending: nothing will ever report them.
        """
        base = unknown_capacity_snapshot(replica_id, now_s)
        return self._set_base(self._replica(replica_id), base)

    def set_concurrency_limit(self, replica_id: str, limit: int | None,
                              first_token_s: float | None = None) -> None:
        """The replica's learned concurrency limit (None: none learned) and its typical
        dispatch-to-first-token time, carried by its snapshots from now on."""
        replica = self._replica(replica_id)
        if (replica.concurrency_limit, replica.first_token_s) == (limit, first_token_s):
            return
        replica.concurrency_limit, replica.first_token_s = limit, first_token_s
        if replica.base is not None:
            self._set_base(replica, replica.base)

    def _set_base(self, replica: _Replica, base: ReplicaSnapshot) -> ReplicaSnapshot:
        """``base`` is the replica's own state now: stamped with what the guard knows of it
        (leaving, weight, learned limits), summed, and its view rebuilt and handed to the
        ranking. At fleet scale what a refresh leaves to the next snapshot is what the whole
        fleet shares, O(1) or a C-level copy: the tuple of every replica's view and the mean
        step-time model's four divisions (at 256 replicas refreshing at 10 Hz most of those
        were made for no decision)."""
        replica_id = base.replica_id
        if base.healthy and replica_id in self._left:  # leaving: never routable again
            base = base.restamped(healthy=False)
        weight = self._weights.get(replica_id, 1.0)
        if base.weight != weight or base.concurrency_limit != replica.concurrency_limit \
                or base.first_token_s != replica.first_token_s:
            base = base.restamped(weight=weight, concurrency_limit=replica.concurrency_limit,
                                  first_token_s=replica.first_token_s)
        replica.base = base
        replica.combined = None
        self._mean_step_time.count(replica_id, replica.model if base.healthy else None)
        self._snapshots = None
        self._step_time = None
        # Built here, in the state poll, rather than by the next decision: at low load a state
        # refresh lands between most requests, so the engine groups' sums are ready before a
        # request needs them instead of being summed on its way to the upstream
        base.load  # noqa: B018  (cached on the snapshot; reservations add to it cheaply)
        self._view_changed(replica_id)  # its view and rank now
        self._changed_ids.discard(replica_id)
        if len(self._mean_step_time) >= MIN_RANKED_REPLICAS:
            # the running sums made where they restart, as on every refresh before; the mean
            # itself (four divisions) and the fleet's tuple wait for the next snapshot
            self._mean_step_time.sum_up()
        else:  # a small fleet's mean sums its replicas' models: made now, as the tuple
            self._views()
        return base

    def served_models(self) -> frozenset[str] | None:
        """The model names the replicas serve; None unless every replica's state document
        names one (a vLLM or unknown-capacity replica leaves the model check to the upstream)."""
        models = []
        for replica in self._replicas.values():
            if replica.base is None:
                continue
            if replica.served_model is None or not replica.base.capacity_known:
                return None
            models.append(replica.served_model)
        return frozenset(models) if models else None

    def served_model(self, replica_id: str) -> str | None:
        """The model name ``replica_id``'s last state document gave (None: it gave none, or no
        state document came from it)."""
        replica = self._replicas.get(replica_id)
        return replica.served_model if replica is not None else None

    def mark_unhealthy(self, replica_id: str, now_s: float) -> None:
        """The replica stopped answering: policies no longer pick it until a good state arrives."""
        replica = self._replica(replica_id)
        if replica.base is not None and replica.base.healthy:
            self._set_base(replica, replica.base.restamped(healthy=False))
            if self.cache_view is not None:  # it may come back restarted, its cache cold
                self.cache_view.replica_down(replica_id)

    def is_healthy(self, replica_id: str) -> bool:
        replica = self._replicas.get(replica_id)
        return bool(replica and replica.base and replica.base.healthy)

    # --- reservations -----------------------------------------------------------------------

    def reserve(self, replica_id: str, request_id: str, cost: RequestCost,
                now_s: float | None = None) -> Reservation:
        """The guard admitted ``cost`` to ``replica_id`` at ``now_s`` (default: its arrival).

        Counted in the replica's snapshot until the replica reports it or it is released.
        Reserving an id that already holds a reservation replaces it. The returned
        :class:`Reservation` is the request's one in-flight record: its ticket refers to it
        (:attr:`guard.admission.ticket.Ticket.reservation`), the indexes here hold the same object.
        """
        if request_id in self._reservations:
            self.release(request_id)
        reserved_s = cost.arrival_s if now_s is None else now_s
        reservation = Reservation(replica_id, cost, reserved_s)
        if cost.cached_prefix_tokens:
            self._price_cache_hit(reservation)
        self._reservations[request_id] = reservation
        self._add(request_id, reservation)
        return reservation

    def admitted(self, replica_id: str, cost: RequestCost) -> None:
        """An admission to ``replica_id`` stands (booked and counted): the prefix-cache view
        records where the request's prefix went."""
        if self.cache_view is not None:
            self.cache_view.routed(replica_id, cost)

    def reservation(self, request_id: str) -> Reservation | None:
        """The request's reservation while it holds one."""
        return self._reservations.get(request_id)

    def release(self, request_id: str) -> bool:
        """The request ended (ticket released). False if it held no reservation."""
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        self._remove(request_id, reservation.replica_id)
        return True

    def move(self, request_id: str, replica_id: str, now_s: float) -> bool:
        """The request's reservation leaves its replica for ``replica_id`` (the same record:
        its ticket follows it), pending there from ``now_s``. False if it holds none."""
        reservation = self._reservations.get(request_id)
        if reservation is None:
            return False
        self._remove(request_id, reservation.replica_id)
        reservation.move_to(replica_id, now_s)
        if reservation.cost.cached_prefix_tokens:
            self._price_cache_hit(reservation)
        self._add(request_id, reservation)
        return True

    def _price_cache_hit(self, reservation: Reservation) -> None:
        """The prefix the reservation's replica holds for it, in that replica's whole blocks:
        its pending blocks and prefill are only the rest."""
        replica = self._replicas.get(reservation.replica_id)
        block_size = replica.base.block_size if replica is not None and replica.base else 16
        num_cached = reservation.cost.num_cached_tokens_on(reservation.replica_id, block_size)
        reservation.num_cached_tokens = num_cached
        reservation.num_cached_blocks = num_cached // block_size

    def _add(self, request_id: str, reservation: Reservation) -> None:
        """Book ``reservation`` on its replica (pending there; shared when a listener is set)."""
        replica_id = reservation.replica_id
        self._book(replica_id).add(request_id, reservation)
        self._dirty(replica_id)
        if self.pending_listener is not None:
            self.pending_listener.pending_added(replica_id, request_id, reservation.cost)

    def _remove(self, request_id: str, replica_id: str) -> None:
        """Take the request off ``replica_id``'s book (withdrawn from sharing if still pending)."""
        book = self._books[replica_id]
        was_pending = request_id in book.pending
        book.remove(request_id)
        self._dirty(replica_id)
        if was_pending and self.pending_listener is not None:
            self.pending_listener.pending_ended(replica_id, request_id)

    def set_foreign(self, replica_id: str, entries: Mapping[str, RequestCost],
                    now_s: float) -> int:
        """Other guards' pending reservations on ``replica_id`` now (entry id -> cost): new
        ones are added (first seen at ``now_s``), withdrawn ones end. Returns how many were
        new (an entry already reported by the replica is not added again)."""
        known = self._foreign.setdefault(replica_id, {})
        book = self._book(replica_id)
        num_new = 0
        for entry_id in [e for e in known if e not in entries]:
            reservation = known.pop(entry_id)
            if not reservation.reported:
                book.mark_reported(FOREIGN_PREFIX + entry_id)
        for entry_id, cost in entries.items():
            if entry_id not in known:
                reservation = known[entry_id] = Reservation(replica_id, cost, now_s)
                book.add_foreign(FOREIGN_PREFIX + entry_id, reservation)
                num_new += 1
        if num_new or len(known) != len(entries):
            self._dirty(replica_id)
        return num_new

    def num_foreign_blocks(self, replica_id: str) -> int:
        """Worst-case blocks of other guards' reservations still pending on the replica."""
        return sum(r.cost.num_blocks for r in self._foreign.get(replica_id, {}).values()
                   if not r.reported)

    def _dirty(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.combined = None
            self._snapshots = None
            self._changed_ids.add(replica_id)

    def num_reserved_blocks(self, replica_id: str) -> int:
        book = self._books.get(replica_id)
        return book.num_reserved_blocks if book is not None else 0

    def num_inflight(self, replica_id: str) -> int:
        book = self._books.get(replica_id)
        return book.num_inflight if book is not None else 0

    # --- snapshots ----------------------------------------------------------------------------

    def replica_snapshot(self, replica_id: str) -> ReplicaSnapshot | None:
        """The replica's state plus pending reservations; None before its first state."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.base is None:
            return None
        if replica.combined is None:
            replica.combined = self._combine(replica.base, self._books.get(replica_id))
        return replica.combined

    @staticmethod
    def _combine(base: ReplicaSnapshot, book: ReplicaReservations | None) -> ReplicaSnapshot:
        """Engine state + reservations, from the engine sums and the reservations' running sums."""
        if book is None or (book.num_inflight == 0 and not book.pending):
            return base
        totals = book.totals(base.block_size, base.max_num_batched_tokens)
        return base.with_reservations(totals.seqs, book.num_reserved_blocks, book.num_inflight,
                                      totals)

    def _view_changed(self, replica_id: str) -> None:
        """The replica's view (engine state + reservations) rebuilt and handed to the ranking;
        a replica's first one puts the fleet's order out of date (:meth:`_views` remakes it)."""
        view = self.replica_snapshot(replica_id)
        if view is None:
            return
        views = self._views_by_id
        self._joined = self._joined or replica_id not in views
        views[replica_id] = view
        self._ranking.update(view, self._replicas[replica_id].model)

    def _views(self) -> tuple[ReplicaSnapshot, ...]:
        """Every replica's snapshot (engine state + reservations) and the mean step-time
        model, rebuilt where a reserve, release or state update left them out of date."""
        replicas = self._snapshots
        if replicas is None:  # only the replicas changed since are rebuilt and re-ranked
            changed, self._changed_ids = self._changed_ids, set()
            for rid in changed:
                self._view_changed(rid)
            views = self._views_by_id
            if self._joined:  # a replica's first state: the fleet's order is the registration
                self._joined = False  # order
                views = self._views_by_id = {rid: views[rid] for rid in self._replicas
                                             if rid in views}
                self._ranking.set_order(views)
            replicas = self._snapshots = tuple(views.values())
        if self._step_time is None:
            self._mean_model(replicas)
        return replicas

    def views(self) -> tuple[tuple[ReplicaSnapshot, ...], StepTimeModel]:
        """Every replica's snapshot and the mean step-time model, as :meth:`snapshot` gives
        them, without the ranked fleet: ranking forecasts every replica changed since the
        last view, which the next decision's snapshot does at its own time (a state round's
        reader of the replicas' limits needs none of it)."""
        replicas = self._snapshots
        if replicas is None or self._step_time is None:
            replicas = self._views()
        return replicas, self._step_time

    def snapshot(self, now_s: float, num_queued: int = 0, drain_rate_rps: float = 0.0,
                 retry_budget: RetryBudgetView = NO_RETRY_OVER_BUDGET,
                 queued_ahead: QueuedAhead = NOTHING_AHEAD) -> LoadSnapshot:
        replicas = self._snapshots
        if replicas is None or self._step_time is None:
            replicas = self._views()
        # one per request, positional in field order: now, replicas, step time, queued,
        # staleness bound, drain rate, retry budget, queue ahead, the ranked fleet
        return LoadSnapshot(
            now_s, replicas, self._step_time,
            num_queued, self._max_staleness_s, drain_rate_rps, retry_budget, queued_ahead,
            self._ranking.view(now_s))

    def step_time_model(self, replica_id: str) -> StepTimeModel:
        replica = self._replicas.get(replica_id)
        return replica.model if replica else self._default_prior

    def fitter(self, replica_id: str) -> StepTimeFitter | None:
        """The replica's fitter (for exporting its prediction error), None if unknown."""
        replica = self._replicas.get(replica_id)
        return replica.fitter if replica else None

    def _mean_model(self, replicas: tuple[ReplicaSnapshot, ...]) -> StepTimeModel:
        if len(self._mean_step_time) >= MIN_RANKED_REPLICAS:  # O(1) per refresh at scale
            self._step_time = self._mean_step_time.mean(self._default_prior)
            return self._step_time
        models = [self._replicas[s.replica_id].model for s in replicas if s.healthy]
        if not models:
            self._step_time = self._default_prior
        else:
            columns = zip(*(m.as_tuple() for m in models), strict=True)
            self._step_time = StepTimeModel(*(sum(c) / len(models) for c in columns))
        return self._step_time

