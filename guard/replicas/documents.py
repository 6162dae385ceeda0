"""A replica's own state (without the guard's reservations) as an immutable ``ReplicaSnapshot``.

Three sources: a kvguard replica's ``/kvguard/state`` JSON (every sequence listed, by request
id), a black-box vLLM replica's ``/metrics`` text (counts only: running requests share the used
KV evenly, unknown lengths are assumed), and a replica that publishes no state at all (healthy,
unknown capacity: ``capacity_known=False``, so policies fall back to their stale-state rule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from guard.replicas.vllm_metrics import parse_vllm_metrics
from policies.cost import RequestCost
from policies.snapshot import ReplicaSnapshot, SeqLoad

__all__ = [
    "UNKNOWN_MAX_MODEL_LEN",
    "UNKNOWN_NUM_BLOCKS",
    "kvguard_snapshot",
    "unknown_capacity_snapshot",
    "vllm_snapshot",
]

# ReplicaSnapshot.max_model_len for a black-box replica whose context length nobody configured
UNKNOWN_MAX_MODEL_LEN = 1 << 30
# KV blocks (and sequence slots) of a replica that publishes no load state at all
UNKNOWN_NUM_BLOCKS = 1 << 30


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
        running=tuple(_seq_load(s, our_cost(s["request_id"])) for s in state["running"]),
        waiting=tuple(_seq_load(s, our_cost(s["request_id"])) for s in state["waiting"]),
    )


def _seq_load(seq: Mapping[str, Any], cost: RequestCost | None) -> SeqLoad:
    num_output = int(seq["num_output_tokens"])
    max_tokens = seq.get("max_tokens")
    remaining_max = max(0, int(max_tokens) - num_output) if max_tokens is not None else None
    itl_s = None
    if cost is not None:  # ours: we know its class and expected length
        expected = max(1, cost.num_expected_output_tokens - num_output)
        remaining = expected if remaining_max is None else min(remaining_max, expected)
        itl_s = cost.request_class.itl_s
    else:
        remaining = remaining_max if remaining_max is not None else 1
    return SeqLoad(
        num_context_tokens=int(seq["num_context_tokens"]),
        num_prefill_tokens_remaining=int(seq["num_prefill_tokens_remaining"]),
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
