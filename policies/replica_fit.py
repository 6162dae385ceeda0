"""Whether a request fits one replica now: the checks the SLO policy (:mod:`policies.slo`)
admits on.

* :func:`fits_now`: no wait for blocks or a slot, the first token by the deadline with the
  TTFT headroom (and by the client's patience, while one is learned), the joined decode step
  within the class ITL and every running stream's, and the next prefill step within the
  tightest running ITL (:func:`paced`, :mod:`policies.prefill_pacing`);
* :func:`fits_but_pacing`: all of those but the pacing (a replica that will fit once its
  pending prefill drains a step or two);
* :func:`first_token_by_s`: when the first token must land — the deadline, or earlier while a
  client patience estimate says the whole response must end within it;
* :func:`itl_attainable`: alone on the replica, one decode step meets the class ITL.

Pure functions of the request, the snapshot and one replica's forecast.
"""

from __future__ import annotations

from policies.client_patience import Patience
from policies.cost import RequestCost
from policies.predictor import TtftForecast
from policies.prefill_pacing import prefill_fits_gaps
from policies.snapshot import LoadSnapshot, ReplicaSnapshot

__all__ = ["first_token_by_s", "fits_but_pacing", "fits_now", "itl_attainable", "paced"]


def fits_now(cost: RequestCost, snapshot: LoadSnapshot, replica: ReplicaSnapshot,
             f: TtftForecast, ttft_s: float, safety_ratio: float,
             patience_s: Patience | None, itl_ratio: float) -> bool:
    """No wait for blocks or a slot, the first token by the deadline with the headroom, the
    joined decode step within the class ITL and every running stream's, and the next prefill
    step within the tightest running ITL (prefill pacing)."""
    return (fits_but_pacing(cost, snapshot, replica, f, ttft_s, safety_ratio, patience_s)
            and paced(cost, snapshot, replica, f, itl_ratio))


def paced(cost: RequestCost, snapshot: LoadSnapshot, replica: ReplicaSnapshot,
          f: TtftForecast, itl_ratio: float) -> bool:
    """The next prefill step, this prompt in, within the tightest running ITL."""
    return not (replica.load.num_seqs and f.num_queued_prefill_tokens  # else nothing to pace
                and not prefill_fits_gaps(cost, replica, snapshot.step_time, snapshot.now_s,
                                          f.num_queued_prefill_tokens, itl_ratio))


def fits_but_pacing(cost: RequestCost, snapshot: LoadSnapshot, replica: ReplicaSnapshot,
                    f: TtftForecast, ttft_s: float, safety_ratio: float,
                    patience_s: Patience | None) -> bool:
    """Every check of :func:`fits_now` but the prefill pacing."""
    if f.num_missing_blocks > 0 or f.num_missing_seqs > 0:
        return False
    now_s = snapshot.now_s
    if now_s + ttft_s * safety_ratio > cost.deadline_s:
        return False
    join_step_s = f.join_step_s
    if join_step_s > cost.request_class.itl_s:
        return False
    load = replica.load
    if load.min_itl_s is not None and join_step_s > load.min_itl_s:
        return False
    return patience_s is None or now_s + ttft_s * safety_ratio <= first_token_by_s(
        cost, snapshot, f, patience_s)


def first_token_by_s(cost: RequestCost, snapshot: LoadSnapshot, f: TtftForecast,
                     patience: Patience | None) -> float:
    """When the first token must land: the class deadline, and — while a client patience
    estimate is active — early enough that the expected decode (expected output tokens × the
    forecast join step, or × the decode time per token recent streams saw when that is
    longer) ends within the patience from arrival. A request that could not end within the
    patience even alone on an idle replica is held to its deadline only: shedding it would not
    be the load's doing."""
    if patience is None:
        return cost.deadline_s
    patience_s, step_s, runs_to_max_tokens = patience
    # While recent answers ran to their max_tokens, a request's own max_tokens is its length.
    # The guard's pricer already counts capped and abandoned endings as lower bounds
    # (guard.request.output_lengths); a cost priced by anything else may hold a plain mean of the
    # survivors (the short requests that finished before their clients left), and a long
    # request priced at it is admitted only to be abandoned.
    num_steps = max(0, (cost.max_tokens if runs_to_max_tokens
                        else cost.num_expected_output_tokens) - 1)
    alone_s = f.own_prefill_s + num_steps * snapshot.step_time.step_s(0, 1, cost.num_prompt_tokens)
    if alone_s > patience_s:
        return cost.deadline_s
    if step_s is None or step_s < f.join_step_s:
        step_s = f.join_step_s
    return min(cost.deadline_s, cost.arrival_s + patience_s - num_steps * step_s)


def itl_attainable(cost: RequestCost, snapshot: LoadSnapshot, replica: ReplicaSnapshot) -> bool:
    """Alone on the replica, the request's decode step would meet its class ITL."""
    alone_s = snapshot.step_time.step_s(0, 1, cost.num_prompt_tokens)
    return alone_s <= cost.request_class.itl_s
