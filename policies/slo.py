"""The default policy: SLO-aware admission.

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
   forecast is short by the headroom ``ttft_safety_ratio`` while the policy is under
   pressure (default 1.2: the forecast × 1.2 must fit — measured forecasts are within ~20 %,
   and at capacity a request admitted on the edge of its deadline misses on any error and
   displaces one with slack), the joined decode
   step is within the class ITL limit and within every declared ITL limit of the sequences
   already there (no running stream is pushed past its ITL), and the prefill landing in the
   next engine step — everything admitted since the last state refresh included — keeps that
   step within the tightest ITL of the replica's streams even if the step forecast is short by
   ``itl_safety_ratio`` (default 1.2, always applied: pacing only delays an admission by a step
   or two, and it fills steps up to this bound, so without headroom any step-forecast error is
   a missed gap for every running stream) (:mod:`policies.prefill_pacing`);
   Among those, the replica that holds the most of the request's prefix in its cache
   (``cost.cached_prefix_tokens``) wins, if its forecast is within ``cache_affinity_ratio`` of
   the lowest (default unbounded: sticky for as long as it fits now — its blocks, a slot, the
   deadline with the headroom, every ITL). A cold prefill costs the whole fleet compute and
   every stream beside it a long step (measured on the shared-prefix bake-off: routing by
   the lowest forecast alone spread the prefixes, and the cold prefills broke most streams'
   gaps), while a warm replica's longer forecast still lands by the deadline; affinity breaks
   when the replica holding the prefix saturates. A warmer replica that fits but for the
   prefill pacing is waited for (``itl_wait``) rather than passed over for a colder one;
5. otherwise the request would have to wait. A retry whose tenant (or the whole guard) is over
   its retry budget (:mod:`policies.retry_budget`) is shed first, told not to retry
   (503 ``retry_shed``, ``should_retry=False``). Then the fast no: the forecast is made for
   the earliest start the request can have — behind the requests already in the guard's queue
   ahead of it (``snapshot.queued_ahead``; on each replica, those expected there: a waiter
   whose prefix a replica holds counts only where the most of it is) — and only if some replica still predicts a first
   token by the deadline (blocks free up, the batch shrinks, the prefill backlog drains) is it
   queued, until ``deadline - own prefill`` (``kv_wait`` or ``itl_wait``); the guard re-decides
   it on every completion and state refresh and sheds queued requests in :func:`shed_order`;
6. else shed 503 at once: ``no_kv_capacity`` when blocks are what is short (``retry_after_s`` =
   the predicted time until enough blocks free), ``slo_unattainable`` otherwise
   (``retry_after_s`` left to the guard's drain-rate estimate).

Pressure: the headroom applies for ``pressure_hold_s`` after the policy last shed a request
for overload (its forecast missed the deadline). Below capacity nothing is shed, and a request
whose forecast fits only without the headroom is admitted: there it displaces no one, and a
likely success is worth more than a certain loss (measured: at ~0.8 C on the A100 sim the fixed
headroom shed requests the bare replica served within their TTFT).

Weights (``ReplicaSnapshot.weight``): a fresh forecast already prices each replica's own
load, so weight does not bend it; it only breaks exact ties of the forecast (idle replicas
forecast alike) in least-loaded order, requests ÷ weight first. Without fresh state (a replica
with ``state_source = "none"``) the stale rule below routes by requests ÷ weight, so there the
traffic splits as the weights say.

Stale rule (:mod:`policies.stale_rule`): with no fresh state the policy cannot predict, so it
admits by load alone up to a cap (``stale_max_inflight_per_replica``, or each replica's learned
concurrency limit), queues for at most ``stale_queue_s``, then sheds 503 ``stale_state``.

Client patience (:mod:`policies.client_patience`): a client that disconnects from an admitted
request before its response ends shows how long it was willing to wait (arrival → release).
Patience is learned per client — the class, the tenant and the client software its
``User-Agent`` names — since one app's 9 s timeout says nothing of another's. When a client's
cancellations are at least ``min_cancel_share`` (default 5 %) of its recent outcomes
(completions and client cancellations, the last 200 within 30 s, at least 20 of them and 5
cancellations), the ``patience_quantile``-th quantile (default 0.25) of elapsed-at-cancel
becomes its patience, and steps 4–5 also require the first token early enough that the
expected decode (``num_expected_output_tokens`` × the forecast join step, or × the median
decode time per token of the class's latest 16 streams, completed or abandoned, when that is
longer: under load, prefill chunks stretch every stream's steps; and the request's own
``max_tokens`` instead of the learned mean while most of the latest completions ran to their
limit) ends within the patience from arrival: a request that would fit its TTFT but be
abandoned mid-stream is queued while that could still change, else shed as overload (the same
reasons and retry advice). This stops the timeout-and-retry loop in which every admitted
attempt is abandoned and retried, so the load never falls below capacity, without holding the
patient clients to the impatient ones' limit. A request that could not end within the
patience even alone on an idle replica is held to its TTFT only. Only the client's own
disconnects count (never a request the guard itself cancelled, e.g. at shutdown). Once
started, the estimate holds until 60 s after the client's last cancellation — cancellations
stopping is what the check achieves, not a sign the clients became patient. With no
cancellations the decisions are exactly those described above.

Fleet scale (:mod:`policies.candidates`): when the snapshot carries the guard's ranked fleet,
steps 4-6 run over a bounded candidate set — the ``num_candidates_best`` best-ranked replicas
and ``num_candidates_sampled`` of the rest in turn — instead of every replica. A fleet within
that bound is wholly the candidate set (the full scan's decision exactly); a request past its
deadline or over the fleet's largest context or KV, no fresh candidate, or a request no
candidate can ever hold, is decided by the full scan, so steps 1-3 stay exact.

``predicted_ttft_s`` on Admit and Queue is counted from the request's arrival (time already
spent plus the forecast from now), so the guard can compare it with the TTFT it measures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from policies.always_admit import NO_REPLICA
from policies.candidates import RankedFleet, pick_candidates
from policies.client_patience import ClientPatience, Patience
from policies.cost import RequestCost
from policies.decision import CompletionSample, Decision, Queue, Shed
from policies.param_check import check_int
from policies.predictor import TtftForecast, forecast
from policies.replica_choice import Option, admit
from policies.replica_fit import first_token_by_s, itl_attainable
from policies.shed_reasons import (
    CONTEXT_LENGTH_EXCEEDED,
    ITL_WAIT,
    KV_WAIT,
    NO_KV_CAPACITY,
    RETRY_SHED,
    SLO_UNATTAINABLE,
    STALE_STATE,
)
from policies.snapshot import NOTHING_AHEAD, LoadSnapshot, ReplicaSnapshot
from policies.stale_rule import RETRY_OVER_BUDGET, decide_stale, is_retry_over_budget

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




def shed_order(costs: Iterable[RequestCost]) -> list[RequestCost]:
    """Queued requests in eviction order: least important class first, retries before first
    attempts, then latest deadline."""
    return sorted(costs, key=lambda c: (-c.request_class.priority, not c.is_retry,
                                        -c.deadline_s, c.request_id))


class SloPolicy:
    name = "slo"
    observes_completions = True  # observe() learns client patience from cancellations

    def __init__(
        self,
        stale_max_inflight_per_replica: int = 4,
        stale_queue_s: float = 0.5,
        ttft_safety_ratio: float = 1.2,
        itl_safety_ratio: float = 1.2,
        pressure_hold_s: float = 5.0,
        patience_quantile: float = 0.25,
        min_cancel_share: float = 0.05,
        use_learned_limits: bool = True,
        cache_affinity_ratio: float = math.inf,
        num_candidates_best: int = 8,
        num_candidates_sampled: int = 4,
    ) -> None:
        self.patience = ClientPatience(patience_quantile, min_cancel_share)
        self.num_candidates_best = check_int("num_candidates_best", num_candidates_best, 1)
        self.num_candidates_sampled = check_int("num_candidates_sampled",
                                                num_candidates_sampled, 0)
        self._turn = 0  # which window of the rest of the fleet the next decision samples
        if stale_queue_s < 0:
            raise ValueError(f"stale_queue_s must be >= 0, got {stale_queue_s!r}")
        if not pressure_hold_s >= 0:
            raise ValueError(f"pressure_hold_s must be >= 0, got {pressure_hold_s!r}")
        self.pressure_hold_s = pressure_hold_s
        self._last_overload_shed_s: float | None = None
        self.stale_max_inflight_per_replica = check_int(
            "stale_max_inflight_per_replica", stale_max_inflight_per_replica, 0
        )
        self.stale_queue_s = stale_queue_s
        if not isinstance(use_learned_limits, bool):
            raise ValueError(f"use_learned_limits must be true or false, got {use_learned_limits!r}")
        self.use_learned_limits = use_learned_limits
        if not 1.0 <= ttft_safety_ratio <= 10.0:
            raise ValueError(f"ttft_safety_ratio must be in [1, 10], got {ttft_safety_ratio!r}")
        self.ttft_safety_ratio = ttft_safety_ratio
        if not 1.0 <= itl_safety_ratio <= 10.0:
            raise ValueError(f"itl_safety_ratio must be in [1, 10], got {itl_safety_ratio!r}")
        self.itl_safety_ratio = itl_safety_ratio
        if not cache_affinity_ratio >= 0.0:
            raise ValueError(f"cache_affinity_ratio must be >= 0, got {cache_affinity_ratio!r}")
        self.cache_affinity_ratio = cache_affinity_ratio

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        candidates = self._fresh_candidates(cost, snapshot)
        if candidates is not None:
            decision = self._decide_among(cost, snapshot, candidates)
            if decision is not None:
                return decision
        return self._decide_full_scan(cost, snapshot)

    def _fresh_candidates(self, cost: RequestCost,
                          snapshot: LoadSnapshot) -> list[ReplicaSnapshot] | None:
        """The fresh replicas of the bounded candidate set (:mod:`policies.candidates`), or
        None where only the full scan decides exactly: no ranked fleet on the snapshot, the
        request over the fleet's largest context or KV, past its deadline, or no candidate
        fresh (steps 1-3 then need every replica)."""
        fleet = snapshot.fleet
        if (fleet is None or not fleet.ranked
                or cost.num_prompt_tokens + cost.max_tokens > fleet.max_model_len
                or cost.num_blocks > fleet.max_total_blocks
                or snapshot.now_s >= cost.deadline_s):
            return None
        self._turn += 1
        now_s, max_staleness_s = snapshot.now_s, snapshot.max_staleness_s
        chosen = pick_candidates(fleet, self.num_candidates_best, self.num_candidates_sampled,
                                 self._turn)
        if cost.cached_prefix_tokens:  # the replicas holding the request's prefix compete too
            chosen = _with_prefix_holders(chosen, fleet, cost.cached_prefix_tokens)
        fresh = [r for r in chosen if now_s - r.observed_s <= max_staleness_s]
        return fresh or None

    def _decide_among(self, cost: RequestCost, snapshot: LoadSnapshot,
                      fresh: list[ReplicaSnapshot]) -> Decision | None:
        """Steps 4-6 over ``fresh``; None when the request fits none of them at all (the
        full scan then tells a request no replica can ever hold from one that must wait)."""
        now_s = snapshot.now_s
        step_time = snapshot.step_time
        options = []
        for r in fresh:
            f = forecast(cost, r, step_time, NOTHING_AHEAD, now_s)
            if f is not None:
                options.append((r, f))
        if not options:
            return None
        ratio = self.headroom_ratio(now_s)
        patience_s = self.patience.estimate(cost.request_class.name, now_s, cost.tenant,
                                            cost.client)
        return (admit(cost, snapshot, options, ratio, patience_s, self.itl_safety_ratio,
                       self.cache_affinity_ratio)
                or self._queue_or_shed(cost, snapshot, options, ratio, patience_s))

    def _decide_full_scan(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        # One pass over the replicas for steps 1-3 and the fresh ones, in plain loops with
        # never_fits and LoadSnapshot.fresh_replicas inlined.
        replicas = snapshot.replicas
        now_s = snapshot.now_s
        max_staleness_s = snapshot.max_staleness_s
        num_reserved_tokens = cost.num_prompt_tokens + cost.max_tokens
        num_blocks = cost.num_blocks
        servable = healthy = False
        fresh = []
        for r in replicas:
            if num_reserved_tokens <= r.max_model_len and num_blocks <= r.num_total_blocks:
                servable = True
            if r.healthy:
                healthy = True
                if r.capacity_known and now_s - r.observed_s <= max_staleness_s:
                    fresh.append(r)
        if not servable and replicas:
            return _never_servable(cost, replicas)
        if not healthy:
            return Shed(503, NO_REPLICA)
        if now_s >= cost.deadline_s:
            return Shed(503, SLO_UNATTAINABLE)
        if not fresh:
            return decide_stale(cost, snapshot, [r for r in replicas if r.healthy],
                                self.stale_max_inflight_per_replica, self.stale_queue_s,
                                self.use_learned_limits, self.ttft_safety_ratio)
        step_time = snapshot.step_time
        options = []
        for r in fresh:
            f = forecast(cost, r, step_time, NOTHING_AHEAD, now_s)
            if f is not None:
                options.append((r, f))
        last_s = self._last_overload_shed_s  # headroom_ratio(), inlined: once per decision
        ratio = (self.ttft_safety_ratio if last_s is not None
                 and 0.0 <= now_s - last_s <= self.pressure_hold_s else 1.0)
        patience_s = self.patience.estimate(cost.request_class.name, now_s, cost.tenant,
                                            cost.client)
        return (admit(cost, snapshot, options, ratio, patience_s, self.itl_safety_ratio,
                       self.cache_affinity_ratio)
                or self._queue_or_shed(cost, snapshot, options, ratio, patience_s))

    def headroom_ratio(self, now_s: float) -> float:
        """``ttft_safety_ratio`` under pressure (an overload shed within ``pressure_hold_s``),
        else 1.0."""
        last_s = self._last_overload_shed_s
        if last_s is not None and 0.0 <= now_s - last_s <= self.pressure_hold_s:
            return self.ttft_safety_ratio
        return 1.0

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        pass

    def observe(self, sample: CompletionSample) -> None:
        """Completions and the clients' own cancellations feed the patience estimate; the
        guard's own cancellations (shutdown) and every other outcome are left out."""
        if sample.outcome == "completed":
            max_tokens = sample.max_tokens
            self.patience.record(sample.class_name, sample.now_s, sample.elapsed_s, False,
                                 _decode_step_s(sample),
                                 max_tokens is not None and sample.num_output_tokens >= max_tokens,
                                 sample.tenant, sample.client)
        elif sample.outcome == "canceled" and sample.client_left and sample.elapsed_s is not None:
            self.patience.record(sample.class_name, sample.now_s, sample.elapsed_s, True,
                                 _decode_step_s(sample), None, sample.tenant, sample.client)

    def client_patience(self, now_s: float) -> dict[str, float]:
        """The active patience estimate per class at ``now_s`` (the
        ``kvguard_client_patience_seconds`` gauge); a class without one is absent."""
        return self.patience.active(now_s)

    def _queue_or_shed(
        self, cost: RequestCost, snapshot: LoadSnapshot, options: list[Option], ratio: float,
        patience_s: Patience | None = None,
    ) -> Decision:
        now_s = snapshot.now_s
        if is_retry_over_budget(cost, snapshot):
            return RETRY_OVER_BUDGET
        ahead = snapshot.queued_ahead
        if ahead.num_requests:  # the fast no: forecast the earliest start, behind the queue
            # ``options`` holds every fresh replica the request can ever fit (forecast behind
            # nothing, at this instant): their pending prefill is known, not walked again
            behind = []
            for r, alone in options:
                f = forecast(cost, r, snapshot.step_time, ahead, now_s,
                             pending=alone.num_queued_prefill_tokens)
                if f is not None:
                    behind.append((r, f))
            options = behind
        later = [
            (r, f)
            for r, f in options
            if now_s + f.ttft_s * ratio <= first_token_by_s(cost, snapshot, f, patience_s)
            and itl_attainable(cost, snapshot, r)
        ]
        if later:
            _, best = min(later, key=lambda o: o[1].ttft_s)
            until_s = (first_token_by_s(cost, snapshot, best, patience_s)
                       - best.own_prefill_s * ratio)
            if until_s > now_s:
                reason = KV_WAIT if best.is_blocked else ITL_WAIT
                return Queue(until_s, reason, _since_arrival(cost, now_s, best))
        if options and not any(itl_attainable(cost, snapshot, r) for r, _ in options):
            # even alone on an idle replica one decode step exceeds the class ITL: never
            return Shed(503, SLO_UNATTAINABLE, should_retry=False)
        self._last_overload_shed_s = now_s
        return _shed(options)



def _with_prefix_holders(chosen: list[ReplicaSnapshot], fleet: RankedFleet,
                         cached: Mapping[str, int]) -> list[ReplicaSnapshot]:
    """``chosen`` plus every ranked replica expected to hold part of the request's prefix,
    in snapshot order (as the candidates are decided): a warm replica outside the bounded set
    would otherwise be missed, and with it the affinity the full scan finds."""
    ids = {r.replica_id for r in chosen}
    extra = [r for r in fleet.ranked if cached.get(r.replica_id) and r.replica_id not in ids]
    if not extra:
        return chosen
    position = fleet.position
    return sorted((*chosen, *extra), key=lambda r: position[r.replica_id])

def _never_servable(cost: RequestCost, replicas: tuple[ReplicaSnapshot, ...]) -> Shed:
    """The 400 for a request no replica can ever run (``never_fits`` on every one)."""
    if any(cost.num_reserved_tokens <= r.max_model_len for r in replicas):
        return Shed(400, NO_KV_CAPACITY, should_retry=False)
    return Shed(400, CONTEXT_LENGTH_EXCEEDED, should_retry=False)


def _decode_step_s(sample: CompletionSample) -> float | None:
    """A stream's decode time per output token after the first, to its release (``None`` if
    unknown): a completion's, or an abandoned stream's over the tokens relayed before the
    client left."""
    if sample.ttft_s is None or sample.elapsed_s is None or sample.num_output_tokens < 2:
        return None
    return max(0.0, sample.elapsed_s - sample.ttft_s) / (sample.num_output_tokens - 1)


def _shed(options: list[Option]) -> Shed:
    waits = [f.wait_s for _, f in options if f.num_missing_blocks > 0]
    if not options or waits:
        retry_after_s = min(waits) if waits and min(waits) > 0 else None
        return Shed(503, NO_KV_CAPACITY, retry_after_s=retry_after_s)
    return Shed(503, SLO_UNATTAINABLE)


def _since_arrival(cost: RequestCost, now_s: float, f: TtftForecast) -> float:
    return max(0.0, now_s - cost.arrival_s) + f.ttft_s
