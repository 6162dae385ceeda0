"""The default policy: SLO-aware admission (DESIGN.md, "The default policy").

For each fresh, healthy replica the predictor (:mod:`policies.predictor`) forecasts this
request's wait for KV blocks and a sequence slot, the prefill queued ahead of it, its own
prefill and the decode step of the batch once it joins. Then, in order:

1. never servable (prompt + ``max_tokens`` over every replica's ``max_model_len``, or more
   blocks than any replica has): 400, ``should_retry=False``;
2. no healthy replica: 503 ``no_replica``; the deadline already past: 503 ``slo_unattainable``;
3. every healthy replica's state older than ``max_staleness_s``: the conservative stale rule
   below;
4. admit to the replica with the lowest predicted TTFT among those where the request needs no
   wait for blocks or a slot, its first token lands by ``cost.deadline_s`` even if the
   forecast is short by the headroom ``ttft_safety_ratio`` (default 1.2: the forecast × 1.2
   must fit — measured forecasts are within ~20 %, and a request admitted on the edge of its
   deadline misses it on any error), the joined decode
   step is within the class ITL limit and within every declared ITL limit of the sequences
   already there (no running stream is pushed past its ITL);
5. otherwise the request would have to wait. A retry from a tenant whose retry ratio is over
   ``retry_shed_ratio`` is shed first (503 ``retry_shed``). If some replica still predicts a
   first token by the deadline (blocks free up, the batch shrinks), queue it until
   ``deadline - own prefill`` (``kv_wait`` or ``itl_wait``) — counting, when the guard's queue
   holds requests ahead of this one, the time they take to leave at the measured drain rate
   (``snapshot.num_queued / snapshot.drain_rate_rps``), so a request the queue cannot reach
   in time is shed on arrival instead of at its deadline; the guard re-decides it on every
   completion and state refresh and sheds queued requests in :func:`shed_order`;
6. else shed 503: ``no_kv_capacity`` when blocks are what is short (``retry_after_s`` = the
   predicted time until enough blocks free), ``slo_unattainable`` otherwise (``retry_after_s``
   left to the guard's drain-rate estimate).

Stale rule: with no fresh state the policy cannot predict, so it admits to the least-loaded
healthy replica only while the guard's in-flight count is below ``stale_max_inflight_per_replica``
per healthy replica; beyond that it queues for at most ``stale_queue_s`` (state may refresh
meanwhile) and sheds 503 ``stale_state`` once even that would pass the deadline.

``predicted_ttft_s`` on Admit and Queue is counted from the request's arrival (time already
spent plus the forecast from now), so the guard can compare it with the TTFT it measures.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.always_admit import NO_REPLICA
from policies.concurrency_cap import num_inflight
from policies.cost import RequestCost
from policies.decision import Admit, CompletionSample, Decision, Queue, Shed
from policies.least_loaded import least_loaded
from policies.param_check import check_int
from policies.predictor import TtftForecast, forecast, never_fits
from policies.shed_reasons import (
    CONTEXT_LENGTH_EXCEEDED,
    ITL_WAIT,
    KV_WAIT,
    NO_KV_CAPACITY,
    RETRY_SHED,
    SLO_UNATTAINABLE,
    STALE_STATE,
)
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = [
    "SloPolicy",
    "shed_order",
    "SLO_UNATTAINABLE",
    "NO_KV_CAPACITY",
    "STALE_STATE",
    "RETRY_SHED",
    "CONTEXT_LENGTH_EXCEEDED",
    "KV_WAIT",
    "ITL_WAIT",
]


_Option = tuple[ReplicaSnapshot, TtftForecast]


def shed_order(costs: Iterable[RequestCost]) -> list[RequestCost]:
    """Queued requests in eviction order: least important class first, then latest deadline."""
    return sorted(costs, key=lambda c: (-c.request_class.priority, -c.deadline_s, c.request_id))


class SloPolicy:
    name = "slo"
    observes_completions = False  # observe() ignores its sample: the guard need not build it

    def __init__(
        self,
        retry_shed_ratio: float = 0.10,
        stale_max_inflight_per_replica: int = 4,
        stale_queue_s: float = 0.5,
        ttft_safety_ratio: float = 1.2,
    ) -> None:
        if not 0.0 <= retry_shed_ratio <= 1.0:
            raise ValueError(f"retry_shed_ratio must be in [0, 1], got {retry_shed_ratio!r}")
        if stale_queue_s < 0:
            raise ValueError(f"stale_queue_s must be >= 0, got {stale_queue_s!r}")
        self.retry_shed_ratio = retry_shed_ratio
        self.stale_max_inflight_per_replica = check_int(
            "stale_max_inflight_per_replica", stale_max_inflight_per_replica, 0
        )
        self.stale_queue_s = stale_queue_s
        if not 1.0 <= ttft_safety_ratio <= 10.0:
            raise ValueError(f"ttft_safety_ratio must be in [1, 10], got {ttft_safety_ratio!r}")
        self.ttft_safety_ratio = ttft_safety_ratio

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        replicas = snapshot.replicas
        never = _never_servable(cost, replicas)
        if never is not None:
            return never
        for r in replicas:  # plain loops here: a comprehension is one more call per request
            if r.healthy:
                break
        else:
            return Shed(503, NO_REPLICA)
        if snapshot.now_s >= cost.deadline_s:
            return Shed(503, SLO_UNATTAINABLE)
        fresh = snapshot.fresh_replicas()
        if not fresh:
            return self._decide_stale(cost, snapshot, [r for r in replicas if r.healthy])
        step_time = snapshot.step_time
        options = []
        for r in fresh:
            f = forecast(cost, r, step_time)
            if f is not None:
                options.append((r, f))
        return (_admit(cost, snapshot.now_s, options, self.ttft_safety_ratio)
                or self._queue_or_shed(cost, snapshot, options))

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        pass

    def _decide_stale(
        self, cost: RequestCost, snapshot: LoadSnapshot, healthy: list[ReplicaSnapshot]
    ) -> Decision:
        if num_inflight(snapshot) < self.stale_max_inflight_per_replica * len(healthy):
            return Admit(least_loaded(healthy).replica_id)
        if self._is_retry_over_ratio(cost, snapshot):
            return Shed(503, RETRY_SHED)
        until_s = min(cost.deadline_s, snapshot.now_s + self.stale_queue_s)
        if until_s > snapshot.now_s:
            return Queue(until_s, STALE_STATE)
        return Shed(503, STALE_STATE)

    def _queue_or_shed(
        self, cost: RequestCost, snapshot: LoadSnapshot, options: list[_Option]
    ) -> Decision:
        now_s = snapshot.now_s
        if self._is_retry_over_ratio(cost, snapshot):
            return Shed(503, RETRY_SHED)
        ahead_s = _queue_ahead_s(snapshot)
        later = [
            (r, f)
            for r, f in options
            if now_s + ahead_s + f.ttft_s * self.ttft_safety_ratio <= cost.deadline_s
            and _itl_attainable(cost, snapshot, r)
        ]
        if later:
            _, best = min(later, key=lambda o: o[1].ttft_s)
            until_s = cost.deadline_s - best.own_prefill_s * self.ttft_safety_ratio
            if until_s > now_s:
                reason = KV_WAIT if best.is_blocked else ITL_WAIT
                return Queue(until_s, reason, _since_arrival(cost, now_s, best))
        if options and not any(_itl_attainable(cost, snapshot, r) for r, _ in options):
            # even alone on an idle replica one decode step exceeds the class ITL: never
            return Shed(503, SLO_UNATTAINABLE, should_retry=False)
        return _shed(options)

    def _is_retry_over_ratio(self, cost: RequestCost, snapshot: LoadSnapshot) -> bool:
        return (
            cost.is_retry
            and snapshot.tenant_retry_ratio.get(cost.tenant, 0.0) > self.retry_shed_ratio
        )


def _never_servable(cost: RequestCost, replicas: tuple[ReplicaSnapshot, ...]) -> Shed | None:
    if not replicas:
        return None
    for r in replicas:
        if not never_fits(cost, r):
            return None
    if any(cost.num_reserved_tokens <= r.max_model_len for r in replicas):
        return Shed(400, NO_KV_CAPACITY, should_retry=False)
    return Shed(400, CONTEXT_LENGTH_EXCEEDED, should_retry=False)


def _admit(cost: RequestCost, now_s: float, options: list[_Option],
           safety_ratio: float) -> Admit | None:
    """The lowest predicted TTFT among the replicas that fit now (the first one on a tie);
    the prediction times ``safety_ratio`` must land by the deadline."""
    best: _Option | None = None
    best_ttft_s = 0.0
    for replica, f in options:
        ttft_s = f.wait_s + f.queued_prefill_s + f.own_prefill_s  # f.ttft_s, inlined
        if (best is None or ttft_s < best_ttft_s) and _fits_now(
                cost, now_s, replica, f, ttft_s * safety_ratio):
            best, best_ttft_s = (replica, f), ttft_s
    if best is None:
        return None
    return Admit(best[0].replica_id, max(0.0, now_s - cost.arrival_s) + best_ttft_s)


def _fits_now(
    cost: RequestCost, now_s: float, replica: ReplicaSnapshot, f: TtftForecast, ttft_s: float
) -> bool:
    if f.num_missing_blocks > 0 or f.num_missing_seqs > 0 or now_s + ttft_s > cost.deadline_s:
        return False
    join_step_s = f.join_step_s
    if join_step_s > cost.request_class.itl_s:
        return False
    min_itl_s = replica.load.min_itl_s
    return min_itl_s is None or join_step_s <= min_itl_s


def _itl_attainable(cost: RequestCost, snapshot: LoadSnapshot, replica: ReplicaSnapshot) -> bool:
    """Alone on the replica, the request's decode step would meet its class ITL."""
    alone_s = snapshot.step_time.step_s(0, 1, cost.num_prompt_tokens)
    return alone_s <= cost.request_class.itl_s


def _shed(options: list[_Option]) -> Shed:
    waits = [f.wait_s for _, f in options if f.num_missing_blocks > 0]
    if not options or waits:
        retry_after_s = min(waits) if waits and min(waits) > 0 else None
        return Shed(503, NO_KV_CAPACITY, retry_after_s=retry_after_s)
    return Shed(503, SLO_UNATTAINABLE)


def _queue_ahead_s(snapshot: LoadSnapshot) -> float:
    """How long the requests queued ahead of this one take to leave, at the measured drain
    rate (0 when nothing is ahead or no rate is measured yet: no early shed on a guess)."""
    if snapshot.num_queued <= 0 or snapshot.drain_rate_rps <= 0:
        return 0.0
    return snapshot.num_queued / snapshot.drain_rate_rps


def _since_arrival(cost: RequestCost, now_s: float, f: TtftForecast) -> float:
    return max(0.0, now_s - cost.arrival_s) + f.ttft_s
