"""What one engine step returns: new tokens per request and the exact iteration record."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IterationRecord", "RequestOutput", "RequestWork", "StepResult"]


@dataclass(frozen=True)
class IterationRecord:
    """One engine iteration, exactly as executed. The guard fits its latency model on these.

    ``num_context_tokens`` is the total KV length (tokens already cached before this step) over
    the decoding sequences; ``duration_s`` is the wall time of the forward pass + sampling (for
    the sim backend: the scaled predicted time it waited).
    """

    batch_id: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    duration_s: float
    end_s: float = 0.0  # time.monotonic() when the step ended


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request from one step. ``step_start_s``/``step_end_s``: the engine
    clock around the step that produced them (None for an abort reported between steps).
    ``num_cached_tokens``: prompt tokens the prefix cache supplied (known once scheduled)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_output_tokens: int
    batch_id: int
    step_start_s: float | None = None
    step_end_s: float | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class RequestWork:
    """One request's part of one step, the units cost accounting shares the step's time by.

    ``num_prefill_tokens``: tokens computed that are not single-token decodes (prompt chunks,
    recomputation); ``num_decode_tokens``: 0 or 1; ``num_kv_read_tokens``: cached tokens this
    request's attention read; ``num_recomputed_tokens``: the part of ``num_prefill_tokens`` that
    a preemption threw away and this step computes again.
    """

    request_id: str
    num_prefill_tokens: int
    num_decode_tokens: int
    num_kv_read_tokens: int
    num_recomputed_tokens: int = 0


@dataclass(frozen=True)
class StepResult:
    outputs: tuple[RequestOutput, ...]
    iteration: IterationRecord | None  # None when nothing was scheduled
    scheduled_request_ids: tuple[str, ...] = ()  # every request in this step's batch
    work: tuple[RequestWork, ...] = ()  # each scheduled request's share of the step
    start_s: float | None = None  # engine clock when the step's forward pass began
