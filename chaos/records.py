"""One request as the load generator saw it: what was planned, what came back, and when.

Times are seconds on the load generator's monotonic clock, relative to the run start
(``scheduled_s``, ``sent_s``) or relative to the send (``ttft_s``, ``e2e_s``).

Outcomes (exactly one per request, the outcome counters seen from the client):

- ``completed``: a 2xx response whose stream ended with ``data: [DONE]`` and no error.
- ``rejected``: the server answered with a 4xx or a 503 (the guard's shed answers).
- ``failed``: any other error — a 5xx other than 503, a transport error, or a stream that
  ended without ``[DONE]`` (``truncated``).
- ``canceled``: the client gave up — its per-request timeout, or the drain deadline.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["OUTCOMES", "RequestSpec", "RequestRecord", "classify_outcome"]

OUTCOMES: tuple[str, ...] = ("completed", "rejected", "failed", "canceled")


@dataclass(frozen=True)
class RequestSpec:
    """One planned arrival: when to send it and what to ask for."""

    index: int
    scheduled_s: float
    num_prompt_tokens: int
    max_tokens: int
    request_class: str
    tenant: str
    # how the prompt is made (chaos.workloads): seeded parts (key, tokens) in order, the same
    # key giving the same tokens in every request that has it; empty: tokens unique to this one
    prompt_parts: tuple[tuple[str, int], ...] = ()
    session_id: str | None = None  # sent as x-session-id (multi-turn conversations)

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if self.scheduled_s < 0:
            raise ValueError(f"scheduled_s must be >= 0, got {self.scheduled_s}")
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("num_prompt_tokens and max_tokens must be >= 1")


def classify_outcome(status: int | None, error: str | None, saw_done: bool,
                     canceled: bool) -> str:
    """Map what the client observed to exactly one outcome name."""
    if canceled:
        return "canceled"
    if status is not None and (400 <= status < 500 or status == 503):
        return "rejected"
    if status is not None and 200 <= status < 300 and saw_done and error is None:
        return "completed"
    return "failed"


@dataclass(frozen=True)
class RequestRecord:
    """The full observation of one request (one line of ``requests.jsonl``)."""

    index: int
    request_class: str
    tenant: str
    num_prompt_tokens: int
    max_tokens: int
    scheduled_s: float
    sent_s: float | None
    outcome: str
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = field(default_factory=tuple)
    e2e_s: float | None = None
    num_tokens_received: int = 0
    usage: dict[str, int] | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    retry_after_s: float | None = None
    retry_after_ms: float | None = None
    should_retry: str | None = None
    reason: str | None = None
    queue_ms: float | None = None
    request_id: str | None = None
    entry: str | None = None  # the entry URL that took the request (several behind a balancer)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")

    @property
    def lag_s(self) -> float | None:
        """How late the request left compared with its schedule (None if never sent)."""
        return None if self.sent_s is None else self.sent_s - self.scheduled_s

    @property
    def truncated(self) -> bool:
        """A 2xx stream that ended without ``[DONE]``."""
        return self.status is not None and 200 <= self.status < 300 and not self.saw_done

    @property
    def successful(self) -> bool:
        return self.outcome == "completed"

    def to_json(self) -> str:
        d = asdict(self)
        d["itl_s"] = list(self.itl_s)
        d["lag_s"] = self.lag_s
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["itl_s"] = tuple(kwargs.get("itl_s") or ())
        return cls(**kwargs)
