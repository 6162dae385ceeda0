"""TTFT and step-time prediction for one request on one replica (pure, used by the SLO policy).

For a request dispatched to a replica now, the first token arrives after

1. the wait for resources: enough KV blocks for its worst case (``cost.num_blocks``) and a
   sequence slot (``max_num_seqs``). Running and waiting sequences have a committed future
   (the blocks their remaining prompt and expected output will still take), so the blocks
   effectively free now are ``free - reserved - committed``. When that is short, sequences are
   taken in order of expected finish (remaining prefill chunks + remaining output tokens), each
   returning its final block count, until the deficit is covered; the wait is that many
   decode steps of the batch holding them, every sequence on the replica decoding (a batch
   of reservations and prompts not yet prefilled has no decode step of its own yet: timing
   the wait by the decode batch of the moment told a flood that four just-admitted requests
   would free their seats 4× sooner than they did);
2. the prefill work queued ahead of it (prompt tokens not yet prefilled by running, waiting and
   reserved sequences), then its own prompt, processed in chunks of
   ``max_num_batched_tokens - num_decode_seqs`` tokens, each chunk step costing
   ``step_s(chunk, num_decode_seqs, running context)``. The first token is sampled by the step
   that finishes its prompt.

A prefix the replica holds in its cache (``cost.cached_prefix_tokens``, whole blocks) is
neither allocated nor prefilled again: the blocks waited for are the request's new ones and its
own prefill is its uncached tokens (:meth:`~policies.cost.RequestCost.num_new_blocks_on`), so a
replica that holds the prefix forecasts a shorter TTFT and wins while it has room, and loses
once its queue or blocks outweigh the hit. Free blocks that hold cached prefixes count as free:
the engine evicts them when it needs room.

So ``ttft_s = wait_s + queued_prefill_s + own_prefill_s``, counted from dispatch (the guard
adds the time already spent since arrival). ``ahead`` (the requests in the guard's own queue
that will be admitted before this one) adds their blocks, slots and prompt tokens to what this
request waits for: without it every queued request forecasts as if it were first in line, and
a flood queues until its deadlines instead of being told no at once. On a replica, the waiters
expected elsewhere (their prefix held there, :class:`~policies.snapshot.QueuedAhead`) are left
out. Given ``now_s``, the
prefill queued on the replica is what is still pending *now*: the backlog it reported, drained
since it was observed, plus the guard's admissions since (:func:`policies.prefill_pacing.
pending_prefill_tokens`); the state is up to one refresh old, and counting all of it again
made the forecast pessimistic by up to a refresh's worth of prefill. A deficit larger than what
every known sequence returns (a queue ahead deeper than the batch) is met by the same sequences'
seats and blocks again, each held first by the request that takes it for a whole run — its
prefill chunks and expected output, this request's own taken as theirs (extrapolating by the
running batch's *remaining* steps instead told a flood that the fifth of four seats frees in a
step or two, so it queued requests that were shed at the next decision). The sum is
conservative: it does not overlap the resource wait with the queued prefill. ``join_step_s``
is the decode step of the batch once it has joined: every sequence on the replica plus this
one, with all prompts in.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

from policies.cost import RequestCost
from policies.prefill_pacing import pending_prefill_tokens
from policies.replica_load import ReplicaLoad
from policies.snapshot import NOTHING_AHEAD, QueuedAhead, ReplicaSnapshot
from policies.step_time import StepTimeModel

__all__ = ["TtftForecast", "forecast", "predict_ttft_s", "prefill_s", "never_fits"]


class TtftForecast(NamedTuple):
    """One request's forecast on one replica (a NamedTuple: built on the decision hot path)."""

    num_missing_blocks: int  # blocks short right now (0: the request fits now)
    num_missing_seqs: int  # sequence slots short right now
    wait_s: float  # until both the blocks and a slot are free
    queued_prefill_s: float
    own_prefill_s: float
    join_step_s: float
    num_queued_prefill_tokens: int = 0  # prompt tokens ahead of it (pending + the guard's queue)

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.queued_prefill_s + self.own_prefill_s

    @property
    def is_blocked(self) -> bool:
        """Dispatching now would leave it waiting inside the engine for blocks or a slot."""
        return self.num_missing_blocks > 0 or self.num_missing_seqs > 0


def never_fits(cost: RequestCost, replica: ReplicaSnapshot) -> bool:
    """The request cannot run on this replica even when it is empty."""
    return (
        cost.num_reserved_tokens > replica.max_model_len
        or cost.num_blocks > replica.num_total_blocks
    )


def forecast(
    cost: RequestCost, replica: ReplicaSnapshot, step_time: StepTimeModel,
    ahead: QueuedAhead = NOTHING_AHEAD, now_s: float | None = None,
    pending: int | None = None,
) -> TtftForecast | None:
    """Predict ``cost`` on ``replica`` if dispatched now, behind ``ahead``; ``None`` when it
    can never fit there. ``pending``: the replica's pending prefill tokens at ``now_s`` when
    the caller has them already (a forecast of the same replica and instant behind nothing
    carries them as ``num_queued_prefill_tokens``): walking the reservations again costs
    O(requests in flight).

    One function on purpose: it runs per replica for every request, on the proxy's path to
    the upstream, so it is one flat pass rather than a chain of small calls. The step-time model
    (:meth:`StepTimeModel.step_s`), :func:`never_fits`, :func:`prefill_s` and the idle case of
    :func:`~policies.prefill_pacing.pending_prefill_tokens` are inlined here, term for term in
    the same order, so the numbers are identical to theirs (a test holds them to it); what
    that saves on the proxy's first token is in docs/benchmarks.md §7.
    """
    num_prompt = cost.num_prompt_tokens
    if (num_prompt + cost.max_tokens > replica.max_model_len  # never_fits(), inlined
            or cost.num_blocks > replica.num_total_blocks):
        return None
    num_blocks = cost.num_blocks
    num_prefill = num_prompt  # what this replica must compute: the prompt less its cache hit
    if cost.cached_prefix_tokens:
        num_cached = cost.num_cached_tokens_on(replica.replica_id, replica.block_size)
        num_prefill -= num_cached
        num_blocks -= num_cached // replica.block_size
    load = replica.load
    base_s = step_time.base_s
    per_seq_s = step_time.per_decode_seq_s
    per_context_s = step_time.per_context_token_s
    per_prefill_s = step_time.per_prefill_token_s
    num_decode_seqs = load.num_decode_seqs
    num_seqs = load.num_seqs
    max_num_seqs = replica.max_num_seqs
    # step_s(0, decode batch, running context)
    decode_s = base_s + per_seq_s * num_decode_seqs + per_context_s * load.num_running_context_tokens
    if ahead.held_total[0]:  # some waiters are expected on given replicas only
        num_ahead, num_ahead_tokens, num_ahead_blocks = ahead.on(replica.replica_id)
    else:
        num_ahead, num_ahead_tokens, num_ahead_blocks = (
            ahead.num_requests, ahead.num_prefill_tokens, ahead.num_blocks)
    available = replica.num_free_blocks - replica.num_reserved_blocks  # num_available_blocks
    missing_blocks = (num_blocks + num_ahead_blocks
                      - ((available if available > 0 else 0) - load.num_committed_blocks))
    missing_seqs = num_seqs + 1 + num_ahead - max_num_seqs
    chunk = replica.max_num_batched_tokens - num_decode_seqs
    if chunk < 1:
        chunk = 1
    wait_s = 0.0
    if missing_blocks > 0 or missing_seqs > 0:
        # one request's whole run (its prefill chunks and expected output): how long a seat
        # that frees up is held again by whoever takes it
        run_steps = -(-num_prefill // chunk) + max(1, cost.num_expected_output_tokens)
        wait_steps = max(_steps_until_freed(load, missing_blocks, run_steps),
                         _steps_until_finished(load, missing_seqs, run_steps))
        # the steps waited are those of the batch that holds the seats and blocks: every
        # sequence there decoding (the ones still to prefill, the guard's reservations among
        # them, decode too before they finish)
        wait_s = wait_steps * step_time.step_s(0, min(max_num_seqs, num_seqs),
                                               load.num_context_tokens)
    if pending is None:
        if now_s is None:
            pending = load.num_queued_prefill_tokens
        elif not load.reserved.seqs and not load.num_queued_prefill_tokens:
            pending = 0  # nothing reported pending, nothing admitted since: nothing to drain
        else:
            pending = pending_prefill_tokens(replica, step_time, now_s)
    num_queued = pending + num_ahead_tokens
    # _prefill_s() twice, inlined: each chunk step costs the decode step plus its tokens
    queued_s = (-(-num_queued // chunk) * decode_s + per_prefill_s * num_queued
                if num_queued > 0 else 0.0)
    num_through = num_queued + num_prefill
    total_s = (-(-num_through // chunk) * decode_s + per_prefill_s * num_through
               if num_through > 0 else 0.0)
    num_join_seqs = num_seqs + 1
    if num_join_seqs > max_num_seqs:
        num_join_seqs = max_num_seqs
    return _new_forecast(TtftForecast, (
        missing_blocks if missing_blocks > 0 else 0,
        missing_seqs if missing_seqs > 0 else 0,
        wait_s,
        queued_s,
        total_s - queued_s,
        # step_s(0, the batch once joined, its context with this prompt in: cached or not,
        # every prompt token is read by attention)
        base_s + per_seq_s * num_join_seqs
        + per_context_s * (load.num_context_tokens + num_prompt),
        num_queued,
    ))


_new_forecast = tuple.__new__  # a TtftForecast without its generated __new__'s frame


def predict_ttft_s(
    cost: RequestCost, replica: ReplicaSnapshot, step_time: StepTimeModel
) -> float | None:
    """Seconds from dispatch to first token on ``replica``; ``None`` when it can never fit there."""
    result = forecast(cost, replica, step_time)
    return None if result is None else result.ttft_s


def prefill_s(num_tokens: int, replica: ReplicaSnapshot, step_time: StepTimeModel) -> float:
    """Time to prefill ``num_tokens`` in chunks beside the replica's running decode batch."""
    load = replica.load
    chunk = max(1, replica.max_num_batched_tokens - load.num_decode_seqs)
    decode_s = step_time.step_s(0, load.num_decode_seqs, load.num_running_context_tokens)
    return _prefill_s(num_tokens, chunk, decode_s, step_time)


def _prefill_s(num_tokens: int, chunk: int, decode_s: float, step_time: StepTimeModel) -> float:
    """Each chunk step costs the decode step plus its prefill tokens."""
    if num_tokens <= 0:
        return 0.0
    return -(-num_tokens // chunk) * decode_s + step_time.per_prefill_token_s * num_tokens


def _steps_until_freed(load: ReplicaLoad, num_missing_blocks: int, run_steps: int) -> int:
    if num_missing_blocks <= 0:
        return 0
    schedule = load.finish_schedule
    if not schedule.num_steps:
        return 0  # no known sequence holds the blocks: nothing to predict a wait from
    freed = schedule.num_freed_blocks
    per_turnover = freed[-1]
    if per_turnover <= 0:
        return 0  # the known sequences return no blocks: nothing to predict a wait from
    rounds = (num_missing_blocks - 1) // per_turnover  # turnovers of everything known first
    i = bisect_left(freed, num_missing_blocks - rounds * per_turnover)
    return schedule.num_steps[i] + rounds * run_steps


def _steps_until_finished(load: ReplicaLoad, num_missing_seqs: int, run_steps: int) -> int:
    """The ``num_missing_seqs``-th seat to free up: the batch's own finishes first, then each
    seat again once the request that took it has run (``run_steps``)."""
    if num_missing_seqs <= 0:
        return 0
    steps = load.finish_schedule.num_steps
    if not steps:
        return 0  # max_num_seqs < 1: nothing running will make room
    rounds, i = divmod(num_missing_seqs - 1, len(steps))
    return steps[i] + rounds * run_steps
