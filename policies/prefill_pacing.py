"""Prefill pacing: admit prompts no faster than running streams can absorb their prefill.

An engine with chunked prefill gives each step up to ``max_num_batched_tokens`` tokens: one per
decoding sequence, the rest to pending prompts, first come first served. Every decoding stream
waits for the whole step, so a step that carries a lot of prefill is a long gap for all of them.
Admissions that each fit on their own add up: several prompts admitted within one state refresh
land in the engine together and are prefilled in the same step.

So before admitting a request next to running streams the SLO policy asks: with the prefill
still pending on the replica (the engine's, drained since it was observed, plus every admission
since — each drained from when it was admitted), does the prefill landing in the next step, this
prompt included, keep that step within the tightest ITL limit of the replica's streams — with
headroom: the predicted step × ``headroom`` must fit, because pacing fills steps up to that
bound, and a step the linear model underestimates by a few per cent is then a missed gap for
every stream (measured on the sim A100: three 270-token prompts beside 17 streams, predicted
0.31 s, took 0.28–0.38 s against a 0.32 s limit)? If not, the request waits a step or two
(``itl_wait``) until the backlog has drained. A prompt that finds
nothing pending goes in alone: one step with its prefill is the least any admission can cost,
and whether that step fits is the replica's chunk budget's doing (:func:`max_step_prefill_tokens`
says how large it may be for an ITL limit; ``kvguard plan`` recommends it).

Pure: the caller passes ``now_s``; pending prefill is estimated from the snapshot, draining one
chunk per chunk-sized step of the step-time model.
"""

from __future__ import annotations

from policies.cost import RequestCost
from policies.snapshot import ReplicaSnapshot
from policies.step_time import StepTimeModel

__all__ = ["max_step_prefill_tokens", "pending_prefill_tokens", "prefill_fits_gaps",
           "full_step_s"]

_UNLIMITED = 1 << 40


def max_step_prefill_tokens(step_time: StepTimeModel, itl_s: float, num_decode_seqs: int,
                            num_context_tokens: int) -> int:
    """The most prefill tokens one step beside this decode batch may carry and still end
    within ``itl_s`` (0 when even the decode step alone is over it)."""
    spare_s = itl_s - step_time.step_s(0, num_decode_seqs, num_context_tokens)
    if spare_s < 0:
        return 0
    if step_time.per_prefill_token_s <= 0:
        return _UNLIMITED
    return int(spare_s / step_time.per_prefill_token_s)


def pending_prefill_tokens(replica: ReplicaSnapshot, step_time: StepTimeModel,
                           now_s: float) -> int:
    """Prompt tokens still to prefill on ``replica`` at ``now_s`` (estimate).

    The backlog the engine reported at ``observed_s`` and each reservation added since (at its
    ``admitted_s``; without one, now) drain first come first served at one chunk per step.
    """
    load = replica.load
    chunk = max(1, replica.max_num_batched_tokens - load.num_decode_seqs)
    chunk_step_s = step_time.step_s(chunk, load.num_decode_seqs, load.num_running_context_tokens)
    drain_rate = chunk / chunk_step_s if chunk_step_s > 0 else float("inf")
    backlog = float(load.running.num_prefill_tokens + load.waiting.num_prefill_tokens)
    t_s = replica.observed_s
    for seq in load.reserved.seqs:
        admitted_s = now_s if seq.admitted_s is None else min(now_s, seq.admitted_s)
        if admitted_s > t_s:
            backlog = max(0.0, backlog - drain_rate * (admitted_s - t_s))
            t_s = admitted_s
        backlog += seq.num_prefill_tokens_remaining
    if now_s > t_s:
        backlog = max(0.0, backlog - drain_rate * (now_s - t_s))
    return int(-(-backlog // 1))


def prefill_fits_gaps(cost: RequestCost, replica: ReplicaSnapshot, step_time: StepTimeModel,
                      now_s: float, pending: int | None = None, headroom: float = 1.0) -> bool:
    """Admitting ``cost`` now keeps the next prefill step within the tightest running ITL
    (``pending``: :func:`pending_prefill_tokens` when the caller has it already) even if the
    step-time model is short by ``headroom`` (the predicted step × ``headroom`` must fit)."""
    load = replica.load
    if load.num_seqs == 0:
        return True  # no stream's gaps to protect
    if pending is None:
        pending = pending_prefill_tokens(replica, step_time, now_s)
    if pending == 0:
        return True  # alone in the next prefill step: pacing cannot make it smaller
    itl_s = load.min_itl_s if load.min_itl_s is not None else cost.request_class.itl_s
    chunk = max(1, replica.max_num_batched_tokens - load.num_decode_seqs)
    own = cost.num_uncached_prompt_tokens_on(replica.replica_id, replica.block_size)
    step_tokens = min(chunk, pending + own)
    return step_tokens <= max_step_prefill_tokens(
        step_time, itl_s / headroom, load.num_decode_seqs, load.num_running_context_tokens)


def full_step_s(replica: ReplicaSnapshot, step_time: StepTimeModel) -> float:
    """One step with a full prefill chunk beside the replica's decode batch: the longest gap a
    long prompt gives every running stream, whatever the pacing (the chunk budget's doing)."""
    load = replica.load
    chunk = max(0, replica.max_num_batched_tokens - load.num_decode_seqs)
    return step_time.step_s(chunk, load.num_decode_seqs, load.num_running_context_tokens)
