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

from collections.abc import Callable, Mapping
from typing import Any

from guard.replicas.engine_metrics import EngineLoad
from guard.replicas.vllm_metrics import parse_vllm_metrics
from policies.cost import RequestCost
from policies.snapshot import ReplicaSnapshot, SeqLoad

__all__ = [
    "UNKNOWN_MAX_MODEL_LEN",
    "UNKNOWN_NUM_BLOCKS",
    "ENGINE_BLOCK_SIZE",
    "engine_snapshot",
    "kvguard_snapshot",
    "listed_request_ids",
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
                     our_cost: Callable[[str], RequestCost | None]) -> ReplicaSnapshot:
    """One ``/kvguard/state`` document received at ``now_s``. ``our_cost(request_id)`` is the
    cost of a request this guard admitted (its class and expected length), else None."""
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


def listed_request_ids(state: Mapping[str, Any]) -> set[str]:
    """The request ids a ``/kvguard/state`` document lists as running or waiting."""
    if "running_columns" in state:
        return {*state["running_columns"]["request_id"], *state["waiting_columns"]["request_id"]}
    return {s["request_id"] for s in (*state["running"], *state["waiting"])}


def _seq_loads(state: Mapping[str, Any], group: str,
               our_cost: Callable[[str], RequestCost | None]) -> tuple[SeqLoad, ...]:
    columns = state.get(f"{group}_columns")
    if columns is None:
        return tuple(_seq_load(s, our_cost(s["request_id"])) for s in state[group])
    return tuple(
        _seq_fields(int(num_output), max_tokens, int(num_context), int(num_prefill),
                    our_cost(request_id))
        for request_id, num_output, max_tokens, num_context, num_prefill in zip(
            columns["request_id"], columns["num_output_tokens"], columns["max_tokens"],
            columns["num_context_tokens"], columns["num_prefill_tokens_remaining"], strict=True))


def _seq_load(seq: Mapping[str, Any], cost: RequestCost | None) -> SeqLoad:
    return _seq_fields(int(seq["num_output_tokens"]), seq.get("max_tokens"),
                       int(seq["num_context_tokens"]), int(seq["num_prefill_tokens_remaining"]),
                       cost)


def _seq_fields(num_output: int, max_tokens: Any, num_context: int, num_prefill: int,
                cost: RequestCost | None) -> SeqLoad:
    remaining_max = max(0, int(max_tokens) - num_output) if max_tokens is not None else None
    itl_s = None
    if cost is not None:  # ours: we know its class and expected length
        expected = max(1, cost.num_expected_output_tokens - num_output)
        remaining = expected if remaining_max is None else min(remaining_max, expected)
        itl_s = cost.request_class.itl_s
    else:
        remaining = remaining_max if remaining_max is not None else 1
    return SeqLoad(
        num_context_tokens=num_context,
        num_prefill_tokens_remaining=num_prefill,
        num_remaining_output_tokens=remaining,
        itl_s=itl_s,
    )


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
