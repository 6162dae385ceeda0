"""Tiny builders shared by the policy tests (hand-sized snapshots, exact numbers)."""

from __future__ import annotations

from policies.cost import RequestClass, RequestCost
from policies.decision import CompletionSample
from policies.retry_budget import RetryBudgetView
from policies.snapshot import NOTHING_AHEAD, LoadSnapshot, QueuedAhead, ReplicaSnapshot, SeqLoad
from policies.step_time import StepTimeModel

INTERACTIVE = RequestClass("interactive", ttft_s=1.0, itl_s=0.08, priority=0)
BATCH = RequestClass("batch", ttft_s=30.0, itl_s=1.0, priority=2)
BLOCK_SIZE = 16

# 10 ms per step, 0.1 ms per prefill token, 1 ms per decoding sequence, context free.
STEP = StepTimeModel(
    base_s=0.01, per_prefill_token_s=0.0001, per_decode_seq_s=0.001, per_context_token_s=0.0
)


def make_cost(
    request_id: str = "r1",
    *,
    prompt: int = 32,
    max_tokens: int = 32,
    klass: RequestClass = INTERACTIVE,
    arrival_s: float = 0.0,
    deadline_s: float | None = None,
    tenant: str = "acme",
    is_retry: bool = False,
    num_blocks: int | None = None,
    client: str = "",
) -> RequestCost:
    blocks = -(-(prompt + max_tokens) // BLOCK_SIZE) if num_blocks is None else num_blocks
    return RequestCost(
        request_id=request_id,
        tenant=tenant,
        request_class=klass,
        num_prompt_tokens=prompt,
        max_tokens=max_tokens,
        num_expected_output_tokens=max_tokens // 2,
        num_blocks=blocks,
        arrival_s=arrival_s,
        deadline_s=arrival_s + klass.ttft_s if deadline_s is None else deadline_s,
        is_retry=is_retry,
        client=client,
    )


def decoding(ctx: int = 32, remaining: int = 16, itl_s: float | None = None) -> SeqLoad:
    return SeqLoad(
        num_context_tokens=ctx,
        num_prefill_tokens_remaining=0,
        num_remaining_output_tokens=remaining,
        itl_s=itl_s,
    )


def prompt_waiting(prompt: int = 100, remaining: int = 10) -> SeqLoad:
    return SeqLoad(
        num_context_tokens=0,
        num_prefill_tokens_remaining=prompt,
        num_remaining_output_tokens=remaining,
    )


def make_replica(
    replica_id: str = "a",
    *,
    free: int = 50,
    total: int = 100,
    running=(),
    waiting=(),
    reserved=(),
    reserved_blocks: int = 0,
    inflight: int = 0,
    healthy: bool = True,
    observed_s: float = 0.0,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    weight: float = 1.0,
) -> ReplicaSnapshot:
    return ReplicaSnapshot(
        replica_id=replica_id,
        observed_s=observed_s,
        block_size=BLOCK_SIZE,
        num_total_blocks=total,
        num_free_blocks=free,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        running=tuple(running),
        waiting=tuple(waiting),
        reserved=tuple(reserved),
        num_reserved_blocks=reserved_blocks,
        num_inflight=inflight,
        healthy=healthy,
        weight=weight,
    )


def make_snapshot(
    *replicas: ReplicaSnapshot, now_s: float = 0.0, retry_over=(), max_staleness_s: float = 2.0,
    queued_ahead: QueuedAhead = NOTHING_AHEAD,
) -> LoadSnapshot:
    """``retry_over``: tenants over their retry budget (``"*"``: the whole guard)."""
    return LoadSnapshot(
        now_s=now_s,
        replicas=tuple(replicas),
        step_time=STEP,
        max_staleness_s=max_staleness_s,
        retry_budget=RetryBudgetView(frozenset(retry_over) - {"*"}, "*" in retry_over),
        queued_ahead=queued_ahead,
    )


def make_sample(
    request_id: str = "r1",
    *,
    now_s: float = 0.0,
    ttft_s: float | None = 0.1,
    max_itl_s: float | None = 0.02,
    prompt: int = 32,
    output: int = 8,
    ok: bool = True,
    tenant: str = "acme",
) -> CompletionSample:
    return CompletionSample(
        request_id=request_id,
        tenant=tenant,
        class_name="interactive",
        replica_id="a",
        now_s=now_s,
        ttft_s=ttft_s,
        max_itl_s=max_itl_s,
        num_prompt_tokens=prompt,
        num_output_tokens=output,
        ok=ok,
        met_slo=ok,
    )
