"""The one object the scheduler hands the runner each step."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams

__all__ = ["ScheduledSeq", "SchedulerOutput"]


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work this step: compute ``token_ids`` at positions
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

    ``block_ids`` is the sequence's whole block table (covering every position computed after
    this step). ``samples`` is True when the sequence catches up with its known tokens this step
    and so produces one new token.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    samples: bool
    params: SamplingParams

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"{self.request_id}: a scheduled sequence needs >= 1 new token")
        if self.num_computed_tokens < 0:
            raise ValueError(f"{self.request_id}: negative num_computed_tokens")

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token that is a generated token: a decode step over a cached context."""
        return self.num_new_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything a runner needs for one step.

    ``finished_request_ids``: requests that finished or were aborted since the previous
    output; a runner may drop all per-request state for them. ``preempted_request_ids``:
    requests whose blocks were taken back since the previous output; they will be scheduled
    again from position 0 (their KV is gone, their sampling state should be kept).
    """

    batch_id: int
    scheduled: tuple[ScheduledSeq, ...]
    finished_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    block_size: int = 16

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed this step that are not single-token decodes (prompt chunks, and
        generated tokens recomputed after preemption)."""
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_context_tokens(self) -> int:
        """Cached tokens (before this step) summed over the decoding sequences."""
        return sum(s.num_computed_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
