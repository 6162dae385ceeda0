"""Which replica the SLO policy (:mod:`policies.slo`) admits a request to, among those it
fits now: the lowest TTFT forecast, ties in least-loaded order, then cache affinity.

Pure: the request, the snapshot and each candidate replica's forecast in, an
:class:`~policies.decision.Admit` (or None: none fits now, or the warm replica is worth
waiting a step for) out.
"""

from __future__ import annotations

from policies.client_patience import Patience
from policies.cost import RequestCost
from policies.decision import Admit
from policies.least_loaded import load_order
from policies.predictor import TtftForecast
from policies.replica_fit import fits_but_pacing, fits_now, paced
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["TTFT_TIE_S", "Option", "admit"]

Option = tuple[ReplicaSnapshot, TtftForecast]  # a replica and the request's forecast there


# Forecasts closer than this are a tie: the TTFT model is not that precise, and the load a
# request adds to (every stream on the replica waits on its steps) then matters more.
TTFT_TIE_S = 0.001


def admit(cost: RequestCost, snapshot: LoadSnapshot, options: list[Option],
          safety_ratio: float, patience_s: Patience | None = None,
          itl_ratio: float = 1.0, affinity_ratio: float = 0.0) -> Admit | None:
    """The lowest predicted TTFT among the replicas that fit now; forecasts within
    ``TTFT_TIE_S`` of each other tie, and a tie goes to the first in least-loaded order
    (requests ÷ weight, then free KV, then the heavier, then the id) — so equal idle replicas
    share a burst by weight, never all to whichever replica's state happened to arrive first.
    The prediction times ``safety_ratio`` must land by the deadline (and, while a client
    patience estimate is active, early enough for the whole response to end within it); the
    next prefill step times ``itl_ratio`` must fit the tightest running ITL.

    Cache affinity: when replicas hold different shares of the request's prefix, a replica
    that fits now and holds more of it wins over the lowest forecast if its own forecast is
    within ``affinity_ratio`` of that one (the forecast is no more precise than that): the
    prefill it saves is compute the whole fleet keeps, and the prefix stays warm in one place
    instead of being prefilled cold beside another replica's running streams."""
    best: Option | None = None
    best_ttft_s = 0.0
    now_s = snapshot.now_s
    for replica, f in options:
        ttft_s = f.wait_s + f.queued_prefill_s + f.own_prefill_s  # f.ttft_s, inlined
        if best is not None:
            if ttft_s > best_ttft_s + TTFT_TIE_S:
                continue
            if ttft_s >= best_ttft_s - TTFT_TIE_S and load_order(replica) >= load_order(best[0]):
                continue
        if fits_now(cost, snapshot, replica, f, ttft_s, safety_ratio, patience_s, itl_ratio):
            best, best_ttft_s = (replica, f), ttft_s
    if best is None:
        return None
    if cost.cached_prefix_tokens and affinity_ratio > 0.0:
        warm = _warmest(cost, snapshot, options, best, best_ttft_s, safety_ratio, patience_s,
                        itl_ratio, affinity_ratio)
        if warm is None:
            return None  # wait a step or two for the warm replica's prefill to drain
        best, best_ttft_s = warm
    return Admit(best[0].replica_id, max(0.0, now_s - cost.arrival_s) + best_ttft_s)


def _warmest(cost: RequestCost, snapshot: LoadSnapshot, options: list[Option], best: Option,
             best_ttft_s: float, safety_ratio: float, patience_s: Patience | None,
             itl_ratio: float, affinity_ratio: float) -> tuple[Option, float] | None:
    """The replica holding the most of the prefix among those that fit now with a forecast
    within ``affinity_ratio`` of the best one (``best`` itself when none holds more) — or
    None (wait) when a replica holding more fits but for the prefill pacing: its pending
    prefill drains in a step or two, while a colder replica would prefill the prefix again
    beside its own streams."""
    bound_s = best_ttft_s * (1.0 + affinity_ratio) + TTFT_TIE_S
    most = cost.num_cached_tokens_on(best[0].replica_id, best[0].block_size)
    paced_out = 0  # the most cached on a replica that fits but for the pacing
    for replica, f in options:
        cached = cost.num_cached_tokens_on(replica.replica_id, replica.block_size)
        if cached <= most:
            continue
        ttft_s = f.ttft_s
        if ttft_s > bound_s or not fits_but_pacing(cost, snapshot, replica, f, ttft_s,
                                                   safety_ratio, patience_s):
            continue
        if paced(cost, snapshot, replica, f, itl_ratio):
            best, best_ttft_s, most = (replica, f), ttft_s, cached
        else:
            paced_out = max(paced_out, cached)
    if paced_out > most:
        return None
    return best, best_ttft_s
