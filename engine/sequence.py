"""One request inside the engine: its tokens, progress, and lifecycle status."""

from __future__ import annotations

import enum

from engine.sampling_params import SamplingParams

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


class Sequence:
    """Mutable request state owned by the scheduler.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. Preemption by recompute
    resets it to 0 and keeps the generated tokens, which are recomputed like prompt tokens.
    ``order`` breaks ties between equal arrival times (admission order to the engine).

    Prefix caching: ``cache_salt`` isolates the request's cached blocks from requests with
    another salt; ``block_hashes`` holds the chained hash of every full block of its known
    tokens (kept across preemption); ``num_cached_tokens`` is how many prompt tokens the prefix
    cache supplied when the request was first scheduled.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        priority: int,
        arrival_s: float,
        order: int,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.arrival_s = arrival_s
        self.order = order
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.block_hashes: list[int] = []
        self.num_cached_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids in positions [start, stop) over prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        head = self.prompt_token_ids[start:] if start < num_prompt else ()
        out_start = max(start - num_prompt, 0)
        return head + tuple(self.output_token_ids[out_start : stop - num_prompt])

    def fcfs_key(self) -> tuple[float, int]:
        return (self.arrival_s, self.order)

    def priority_key(self) -> tuple[int, float, int]:
        """Lower priority value is more important (served first, preempted last)."""
        return (self.priority, self.arrival_s, self.order)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
