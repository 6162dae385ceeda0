"""The fleet in rank order, and the bounded candidate set a decision looks at.

A decision that forecasts every replica costs in proportion to the fleet. Instead the guard
keeps the fleet ranked as replicas change (one replica's state refresh or reservation moves
one entry: :class:`guard.replicas.fleet_ranking.FleetRanking`) and hands the ranking to the
policy on the snapshot (:class:`RankedFleet`). A policy then forecasts only a bounded
candidate set (:func:`pick_candidates`): the ``num_best`` replicas ranked best, plus
``num_sampled`` more taken in turn from the rest, so every replica is looked at now and then
(none starves because its rank key misjudges it for the request at hand).

The rank key (:func:`rank_key`) is request-independent, so it is computed once per replica
change, not per request: the forecast of a reference request (:data:`REFERENCE_COST`) on the
replica under its own fitted step-time model, at the first decision after the change (the
prefill pending there drains with time, so an older key overstates a replica's backlog: it is
looked at later than it deserves, never offered with a backlog it no longer has):
replicas that could take it now before those where it would wait for blocks or a slot, then
those whose next step has room for a longer prompt beside the prefill pending there (a prompt
landing beside pending prefill must keep the step within the running streams' ITL — prefill
pacing; nothing pending, any prompt fits), in tiers of prompt length, then the predicted TTFT,
then least-loaded order.
The policy's choice among the candidates uses the exact forecast of the request itself; the
ranking only decides which replicas it forecasts.

A fleet no larger than ``num_best + num_sampled`` is wholly the candidate set, in the
snapshot's replica order: there the decision is the full scan's exactly. Below
:data:`MIN_RANKED_REPLICAS` the guard keeps no ranking at all and policies scan the fleet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policies.cost import RequestClass, RequestCost
from policies.least_loaded import load_order
from policies.predictor import forecast
from policies.prefill_pacing import max_step_prefill_tokens
from policies.snapshot import ReplicaSnapshot
from policies.step_time import StepTimeModel

__all__ = ["MIN_RANKED_REPLICAS", "REFERENCE_COST", "RankedFleet", "pick_candidates", "rank_key"]

# A typical chat request: what the rank key forecasts on every replica
REFERENCE_COST = RequestCost("rank", "", RequestClass("rank", ttft_s=1.0, itl_s=1.0),
                             num_prompt_tokens=512, max_tokens=128,
                             num_expected_output_tokens=128, num_blocks=40,
                             arrival_s=0.0, deadline_s=0.0)

# Fleets smaller than this are scanned: forecasting a few replicas per request costs less than
# re-ranking the one a reservation changed (docs/benchmarks.md, kvguard bench scale)
MIN_RANKED_REPLICAS = 32

RankKey = tuple[bool, int, float, tuple[float, float, float, str]]
# the ITL a replica's running streams are assumed to need when none declares one
REFERENCE_ITL_S = 0.08
# prompt lengths (tokens) the rank key tells apart by how much of the next step is left
_ROOM_TIERS = (4096, 2048, 1024, 512, 256, 1)


def rank_key(replica: ReplicaSnapshot, step_time: StepTimeModel,
             now_s: float | None = None) -> RankKey:
    """Sort key of a healthy, capacity-known replica at ``now_s``: lower ranks better. With
    ``now_s`` the prefill pending there is what is left of it then (drained since observed)."""
    cost = REFERENCE_COST
    if (cost.num_reserved_tokens > replica.max_model_len
            or cost.num_blocks > replica.num_total_blocks):
        cost = _reference_within(replica)
    f = forecast(cost, replica, step_time, now_s=now_s)
    if f is None:  # not even a one-block request fits: ranked by load alone, last
        return (True, len(_ROOM_TIERS), float("inf"), load_order(replica))
    return (f.num_missing_blocks > 0 or f.num_missing_seqs > 0,
            _room_tier(replica, step_time, f.num_queued_prefill_tokens),
            f.ttft_s, load_order(replica))


def _room_tier(replica: ReplicaSnapshot, step_time: StepTimeModel, num_pending: int) -> int:
    """How long a prompt the next engine step can still take within the running streams'
    ITL (prefill pacing), as a tier: 0 for any prompt (nothing pending, nothing running), then
    each of :data:`_ROOM_TIERS` prompt tokens in turn, ``len(_ROOM_TIERS)`` for none."""
    load = replica.load
    if num_pending == 0 or load.num_seqs == 0:
        return 0
    itl_s = load.min_itl_s if load.min_itl_s is not None else REFERENCE_ITL_S
    room = max_step_prefill_tokens(step_time, itl_s, load.num_decode_seqs,
                                   load.num_running_context_tokens) - num_pending
    for tier, num_tokens in enumerate(_ROOM_TIERS):
        if room >= num_tokens:
            return tier
    return len(_ROOM_TIERS)


def _reference_within(replica: ReplicaSnapshot) -> RequestCost:
    """The reference request shrunk to half of a small replica's context and KV."""
    num_tokens = max(2, min(replica.max_model_len,
                            replica.num_total_blocks * replica.block_size) // 2)
    num_prompt = max(1, num_tokens * 4 // 5)
    return dataclasses.replace(
        REFERENCE_COST, num_prompt_tokens=num_prompt, max_tokens=num_tokens - num_prompt,
        num_expected_output_tokens=max(1, num_tokens - num_prompt),
        num_blocks=-(-num_tokens // replica.block_size))


@dataclass(frozen=True)
class RankedFleet:
    """The guard's fleet view at one instant, for policies that pick among candidates.

    ``ranked``: every healthy replica with known capacity, best :func:`rank_key` first (fresh
    or not: a policy checks freshness on the candidates it takes). ``position``: each replica
    id's index in ``LoadSnapshot.replicas`` (candidates are decided in that order, as the full
    scan does). ``max_model_len`` / ``max_total_blocks``: the largest over every replica in
    the snapshot, healthy or not (a request over either can never be served anywhere).
    ``least_loaded``: the healthy replica (known capacity or not) first in least-loaded order
    (:func:`policies.least_loaded.load_order`), None when none is healthy; ``num_inflight``:
    the guard's in-flight requests over every replica — what the baselines scan the fleet for.
    """

    ranked: tuple[ReplicaSnapshot, ...]
    position: dict[str, int]
    max_model_len: int
    max_total_blocks: int
    least_loaded: ReplicaSnapshot | None = None
    num_inflight: int = 0

    @classmethod
    def of(cls, replicas: tuple[ReplicaSnapshot, ...], step_time: StepTimeModel,
           now_s: float | None = None) -> RankedFleet:
        """The whole fleet ranked at once (every replica under ``step_time``, at ``now_s``):
        what the guard's incremental ranking equals, for callers that keep none."""
        ranked = sorted((r for r in replicas if r.healthy and r.capacity_known),
                        key=lambda r: (rank_key(r, step_time, now_s), r.replica_id))
        return cls(tuple(ranked), {r.replica_id: i for i, r in enumerate(replicas)},
                   max((r.max_model_len for r in replicas), default=0),
                   max((r.num_total_blocks for r in replicas), default=0),
                   min((r for r in replicas if r.healthy), key=load_order, default=None),
                   sum(r.num_inflight for r in replicas))


def pick_candidates(fleet: RankedFleet, num_best: int, num_sampled: int,
                    turn: int) -> list[ReplicaSnapshot]:
    """The ``num_best`` best-ranked replicas and ``num_sampled`` of the rest, the
    ``turn``-th window of them in rank order (wrapping), in snapshot order."""
    ranked = fleet.ranked
    num_rest = len(ranked) - num_best
    if num_rest <= num_sampled:
        chosen = list(ranked)
    else:
        chosen = list(ranked[:num_best])
        start = (turn * num_sampled) % num_rest
        end = start + num_sampled
        chosen.extend(ranked[num_best + start:num_best + end])
        if end > num_rest:
            chosen.extend(ranked[num_best:num_best + end - num_rest])
    position = fleet.position
    chosen.sort(key=lambda r: position[r.replica_id])
    return chosen
