"""A replica's own state (without the guard's reservations) as an immutable ``ReplicaSnapshot``.

Four sources: a kvguard replica's ``/kvguard/state`` JSON (every sequence listed, by request
id: as one object per sequence, or in the compact form as one list per field —
``running_columns`` / ``waiting_columns``, which the engine serves at ``?compact=1``), a
black-box vLLM replica's ``/metrics`` text (counts only: running requests share the used KV
evenly, unknown lengths are assumed), another engine's metrics (SGLang, TGI, llama.cpp:
:class:`guard.replicas.engine_metrics.EngineLoad`; known capacity only where the engine gives
its KV pool's size and usage, else counts with unknown capacity), and a replica that publishes
no state at all (healthy, unknown capacity: ``capacity_known=False``, so policies fall back to
their stale-state rule).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any

from guard.replicas.engine_metrics import EngineLoad
from guard.replicas.stream_view import GroupCapture, LazySeqLoads
from guard.replicas.vllm_metrics import parse_vllm_metrics
from policies.cost import RequestCost
from policies.replica_load import ReplicaLoad, SeqTotals
from policies.snapshot import ReplicaSnapshot, SeqLoad

__all__ = [
    "UNKNOWN_MAX_MODEL_LEN",
    "UNKNOWN_NUM_BLOCKS",
    "ENGINE_BLOCK_SIZE",
    "engine_snapshot",
    "kvguard_snapshot",
    "listed_request_ids",
    "seq_fields",
    "unknown_capacity_snapshot",
    "vllm_snapshot",
]

# ReplicaSnapshot.max_model_len for a black-box replica whose context length nobody configured
UNKNOWN_MAX_MODEL_LEN = 1 << 30
# KV blocks (and sequence slots) of a replica that publishes no load state at all
UNKNOWN_NUM_BLOCKS = 1 << 30
# the block size a snapshot counts in when the engine reports its KV pool in tokens
ENGINE_BLOCK_SIZE = 16


def kvguard_snapshot(replica_id: str, state: Mapping[str, Any], now_s: float,
                     our_cost: Callable[[str], RequestCost | None],
                     ours: Container[str] | None = None) -> ReplicaSnapshot:
    """One ``/kvguard/state`` document received at ``now_s``. ``our_cost(request_id)`` is the
    cost of a request this guard admitted (its class and expected length), else None;
    ``ours`` (optional) holds at least every such request id, so no other is asked about.

    A compact document's groups stay columns (:class:`SeqColumns`: a sequence's
    :class:`~policies.seq_load.SeqLoad` is made only when a policy walks the group) and their
    sums are taken from the columns directly: what every refresh needs (the replica's load
    and rank) costs arithmetic per sequence, not an object."""
    if "running_columns" in state:
        block_size = int(state["block_size"])
        chunk = int(state["max_num_batched_tokens"])
        groups = state["running_columns"], state["waiting_columns"]
        if isinstance(groups[0], GroupCapture):  # a streamed replica's (guard.replicas.stream_view)
            running, waiting = (g.totals(our_cost, ours, chunk, _column_group) for g in groups)
        else:
            running, waiting = (_column_group(g, our_cost, block_size, chunk, ours)
                                for g in groups)
        snapshot = ReplicaSnapshot.assembled(  # built on every refresh: no frozen __init__
            replica_id=replica_id, observed_s=now_s, block_size=block_size,
            num_total_blocks=int(state["num_total_blocks"]),
            num_free_blocks=int(state["num_free_blocks"]),
            max_num_seqs=int(state["max_num_seqs"]), max_num_batched_tokens=chunk,
            max_model_len=int(state["max_model_len"]), running=running.seqs,
            waiting=waiting.seqs)
        cached = snapshot.__dict__  # the cached properties, filled (no reservation here)
        cached["running_totals"], cached["waiting_totals"] = running, waiting
        cached["load"] = ReplicaLoad.of(running, waiting, SeqTotals.empty(block_size, chunk))
        return snapshot
    return ReplicaSnapshot(
        replica_id=replica_id,
        observed_s=now_s,
        block_size=int(state["block_size"]),
        num_total_blocks=int(state["num_total_blocks"]),
        num_free_blocks=int(state["num_free_blocks"]),
        max_num_seqs=int(state["max_num_seqs"]),
        max_num_batched_tokens=int(state["max_num_batched_tokens"]),
        max_model_len=int(state["max_model_len"]),
        running=_seq_loads(state, "running", our_cost),
        waiting=_seq_loads(state, "waiting", our_cost),
    )


def listed_request_ids(state: Mapping[str, Any]) -> Container[str]:
    """The request ids a ``/kvguard/state`` document lists as running or waiting."""
    if isinstance(state.get("running_columns"), GroupCapture):
        return _Listed(state["running_columns"], state["waiting_columns"])
    if "running_columns" in state:
        return {*state["running_columns"]["request_id"], *state["waiting_columns"]["request_id"]}
    return {s["request_id"] for s in (*state["running"], *state["waiting"])}


def _seq_loads(state: Mapping[str, Any], group: str,
               our_cost: Callable[[str], RequestCost | None]) -> tuple[SeqLoad, ...]:
    columns = state.get(f"{group}_columns")
    if columns is None:
        return tuple(_seq_load(s, our_cost(s["request_id"])) for s in state[group])
    return tuple(
        seq_fields(int(num_output), max_tokens, int(num_context), int(num_prefill),
                    our_cost(request_id))
        for request_id, num_output, max_tokens, num_context, num_prefill in zip(
            columns["request_id"], columns["num_output_tokens"], columns["max_tokens"],
            columns["num_context_tokens"], columns["num_prefill_tokens_remaining"], strict=True))


class _Listed:
    """The ids two captured groups list (a membership test, no set built)."""

    __slots__ = ("_groups",)

    def __init__(self, *groups: Container[str]) -> None:
        self._groups = groups

    def __contains__(self, request_id: object) -> bool:
        return any(request_id in g for g in self._groups)


class SeqColumns(LazySeqLoads):
    """One group of a compact document as a sequence of :class:`SeqLoad`, made on first
    use; equal to the tuple of those (either way round)."""

    __slots__ = ("_rows", "_costs")

    def __init__(self, rows: list, costs: dict[int, RequestCost]) -> None:
        super().__init__(len(rows))
        self._rows = rows  # (request id, output, max_tokens, context, prefill) per sequence
        self._costs = costs  # row index -> the guard's cost of it, as of the document

    def _make(self) -> tuple[SeqLoad, ...]:
        seqs = tuple(seq_fields(*row) for row in self._row_tuples())
        self._rows = None  # the records replace the rows
        return seqs

    def _row_tuples(self) -> Iterator[tuple]:
        cost_of = self._costs.get
        return ((int(out), max_tokens, int(ctx), int(pre), cost_of(i))
                for i, (_, out, max_tokens, ctx, pre) in enumerate(self._rows))


def _column_group(columns: Mapping[str, list], our_cost: Callable[[str], RequestCost | None],
                  block_size: int, chunk_tokens: int,
                  ours: Container[str] | None = None) -> SeqTotals:
    """A compact group's :class:`SeqTotals` (exactly ``SeqTotals.of`` over its SeqLoads)
    from its columns, its ``seqs`` a :class:`SeqColumns`: sums over whole columns, then the
    guard's own requests (few: their class and expected length apply) corrected one by one."""
    ids, outs, maxes = columns["request_id"], columns["num_output_tokens"], columns["max_tokens"]
    ctxs, pres = columns["num_context_tokens"], columns["num_prefill_tokens_remaining"]
    bs = block_size
    finals = [c + p + (1 if m is None else m - o if m > o else 0)
              for c, p, m, o in zip(ctxs, pres, maxes, outs, strict=True)]
    num_committed = sum([-(-f // bs) for f in finals]) - sum([-(-c // bs) for c in ctxs])
    costs: dict[int, RequestCost] = {}
    min_itl_s = None
    for i, rid in enumerate(ids):
        if ours is not None and rid not in ours:
            continue
        cost = our_cost(rid)
        if cost is None:
            continue
        costs[i] = cost
        num_output, max_tokens = outs[i], maxes[i]
        expected = max(1, cost.num_expected_output_tokens - num_output)
        remaining = expected if max_tokens is None else min(max(0, max_tokens - num_output),
                                                            expected)
        final = ctxs[i] + pres[i] + remaining
        num_committed += -(-final // bs) - -(-finals[i] // bs)
        itl_s = cost.request_class.itl_s
        if min_itl_s is None or itl_s < min_itl_s:
            min_itl_s = itl_s
    rows = list(zip(ids, outs, maxes, ctxs, pres, strict=True))
    return SeqTotals(SeqColumns(rows, costs), block_size, chunk_tokens, sum(ctxs), sum(pres),
                     num_committed, min_itl_s)


def _seq_load(seq: Mapping[str, Any], cost: RequestCost | None) -> SeqLoad:
    return seq_fields(int(seq["num_output_tokens"]), seq.get("max_tokens"),
                       int(seq["num_context_tokens"]), int(seq["num_prefill_tokens_remaining"]),
                       cost)


def remaining_output(num_output: int, max_tokens: Any, cost: RequestCost | None) -> int:
    """A listed sequence's decode tokens still to come, as a policy counts them
    (``SeqLoad.num_remaining_output_tokens``; ``cost``: the guard's, when it is its own)."""
    remaining_max = max(0, int(max_tokens) - num_output) if max_tokens is not None else None
    if cost is not None:  # ours: we know its expected length
        expected = max(1, cost.num_expected_output_tokens - num_output)
        return expected if remaining_max is None else min(remaining_max, expected)
    return remaining_max if remaining_max is not None else 1


def seq_fields(num_output: int, max_tokens: Any, num_context: int, num_prefill: int,
               cost: RequestCost | None) -> SeqLoad:
    """One listed sequence as a policy sees it (``cost``: the guard's, when it is its own)."""
    return SeqLoad(
        num_context_tokens=num_context,
        num_prefill_tokens_remaining=num_prefill,
        num_remaining_output_tokens=remaining_output(num_output, max_tokens, cost),
        itl_s=None if cost is None else cost.request_class.itl_s,
    )


def finish_ends(rows: Iterable[tuple], block_size: int,
                chunk_tokens: int) -> list[tuple[int, int]]:
    """``SeqTotals.ends`` of the sequences ``rows`` lists as (output, max_tokens, context,
    prefill, the guard's cost or None), without a :class:`SeqLoad` each: ``(steps until
    finished, final blocks)`` per sequence, sorted (``chunk_tokens`` >= 1)."""
    return seq_ends(((remaining_output(o, m, cost), c, p) for o, m, c, p, cost in rows),
                    block_size, chunk_tokens)


def seq_ends(seqs: Iterable[tuple[int, int, int]], block_size: int,
             chunk_tokens: int) -> list[tuple[int, int]]:
    """``SeqTotals.ends`` of sequences given as (remaining output, context, prefill)."""
    bs, chunk = block_size, chunk_tokens
    return sorted(((p + chunk - 1) // chunk + r, (c + p + r + bs - 1) // bs) for r, c, p in seqs)


def vllm_snapshot(replica_id: str, text: str, now_s: float, *, max_model_len: int | None,
                  max_num_seqs: int, max_num_batched_tokens: int, assumed_output_tokens: int,
                  assumed_prompt_tokens: int) -> ReplicaSnapshot:
    """One vLLM ``/metrics`` scrape; limits missing from its ``*_info`` labels come from the
    keyword arguments (see :meth:`guard.replicas.load_state.LoadState.update_from_vllm_metrics`)."""
    m = parse_vllm_metrics(text)
    block_size = int(m.get("block_size", 16))
    total = int(m["num_gpu_blocks"])
    free = int(round(total * (1.0 - m["kv_cache_usage_ratio"])))
    running = int(m["num_requests_running"])
    context = (total - free) * block_size // running if running else 0
    return ReplicaSnapshot(
        replica_id=replica_id,
        observed_s=now_s,
        block_size=block_size,
        num_total_blocks=total,
        num_free_blocks=free,
        max_num_seqs=int(m.get("max_num_seqs", max_num_seqs)),
        max_num_batched_tokens=int(m.get("max_num_batched_tokens", max_num_batched_tokens)),
        max_model_len=int(m.get("max_model_len", max_model_len or UNKNOWN_MAX_MODEL_LEN)),
        running=(SeqLoad(context, 0, assumed_output_tokens),) * running,
        waiting=(SeqLoad(0, assumed_prompt_tokens, assumed_output_tokens),)
        * int(m["num_requests_waiting"]),
        limits_published=False,
    )


def engine_snapshot(replica_id: str, load: EngineLoad, now_s: float, *,
                    max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int,
                    assumed_output_tokens: int, assumed_prompt_tokens: int) -> ReplicaSnapshot:
    """One SGLang / TGI / llama.cpp ``/metrics`` scrape. With the KV pool's size and usage
    (SGLang) the capacity is known, as for vLLM; without them (TGI, llama.cpp) the counts are
    kept but the capacity is unknown, so the replica is admitted to by its learned limit."""
    known = load.num_kv_tokens is not None and load.kv_cache_usage_ratio is not None
    if known:
        total = max(1, load.num_kv_tokens // ENGINE_BLOCK_SIZE)
        free = int(round(total * (1.0 - min(1.0, max(0.0, load.kv_cache_usage_ratio)))))
    else:
        total = free = UNKNOWN_NUM_BLOCKS
    running = load.num_requests_running
    context = (total - free) * ENGINE_BLOCK_SIZE // running if known and running else 0
    return ReplicaSnapshot(
        replica_id=replica_id,
        observed_s=now_s,
        block_size=ENGINE_BLOCK_SIZE,
        num_total_blocks=total,
        num_free_blocks=free,
        max_num_seqs=load.num_slots or (max_num_seqs if known else UNKNOWN_NUM_BLOCKS),
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len or UNKNOWN_MAX_MODEL_LEN,
        running=(SeqLoad(context, 0, assumed_output_tokens),) * running,
        waiting=(SeqLoad(0, assumed_prompt_tokens, assumed_output_tokens),)
        * load.num_requests_waiting,
        capacity_known=known,
        limits_published=False,  # SGLang / TGI / llama.cpp publish no chunk budget or step times
    )


def unknown_capacity_snapshot(replica_id: str, now_s: float) -> ReplicaSnapshot:
    """A replica that answers but publishes no load state: healthy, capacity unknown."""
    return ReplicaSnapshot(
        replica_id=replica_id,
        observed_s=now_s,
        block_size=16,
        num_total_blocks=UNKNOWN_NUM_BLOCKS,
        num_free_blocks=UNKNOWN_NUM_BLOCKS,
        max_num_seqs=UNKNOWN_NUM_BLOCKS,
        max_num_batched_tokens=8192,
        max_model_len=UNKNOWN_MAX_MODEL_LEN,
        capacity_known=False,
        limits_published=False,
    )
