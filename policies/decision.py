"""What a policy answers: admit to a replica, queue until a time, or shed with a reason."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Admit", "Queue", "Shed", "Decision", "CompletionSample"]


@dataclass(frozen=True)
class Admit:
    replica_id: str
    predicted_ttft_s: float | None = None


@dataclass(frozen=True)
class Queue:
    until_s: float  # re-evaluate no later than this; past it the request is shed
    reason: str = "queued"
    predicted_ttft_s: float | None = None


@dataclass(frozen=True)
class Shed:
    status: int  # 429 tenant budget/limit, 503 overload
    reason: str  # short machine-readable reason, sent as x-kvguard-reason
    retry_after_s: float | None = None  # None: the guard derives it from the drain rate
    should_retry: bool = True


Decision = Admit | Queue | Shed


# Built for every request: slotted, not frozen (a frozen __init__ sets each field through
# object.__setattr__; docs/benchmarks.md §2). Never mutated after construction.
@dataclass(slots=True)
class CompletionSample:
    """What a policy learns from when a request finishes (released exactly once)."""

    request_id: str
    tenant: str
    class_name: str
    replica_id: str
    now_s: float
    ttft_s: float | None
    max_itl_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    ok: bool  # completed without error
    met_slo: bool
    outcome: str = "completed"  # the ticket's outcome (guard.admission.ticket.OUTCOMES)
    elapsed_s: float | None = None  # arrival → release
    client_left: bool = False  # the client disconnected before the end (not the guard's doing)
    max_tokens: int | None = None  # what the request allowed (a completion that used it all ran
    #                                to its limit: its length says nothing of the natural one)
    client: str = ""  # the request's client software (RequestCost.client)
