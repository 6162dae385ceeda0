"""One user of a chaos run: every attempt their client made, and what the user got.

A *user* is one arrival of the open-loop schedule: someone who wants one answer. Their client
may make several *attempts* (retries); each attempt is a ``RequestRecord`` whose
``scheduled_s`` is the user's arrival and whose ``sent_s`` is when that attempt left. The user
is judged from the arrival, not from the last attempt:

- ``good``:  an answer whose first token came within the class TTFT of the *arrival* (so
  backoff and failed attempts count against it) and whose every gap met the ITL limit;
- ``late``:  an answer, but not a good one;
- ``error``: no answer, and the service said so explicitly (an HTTP 4xx/5xx status or an SSE
  error event) within the user's patience;
- ``lost``:  neither an answer nor an explicit error within the user's patience (client
  timeouts, refused connections, streams cut without an error event, answers that came after
  the user gave up);
- ``hung``:  the client was still waiting when the run's drain deadline passed and had to be
  canceled by the harness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from chaos.records import RequestRecord
from policies.cost import RequestClass

__all__ = ["USER_OUTCOMES", "UserRecord", "explicit_error"]

USER_OUTCOMES: tuple[str, ...] = ("good", "late", "error", "lost", "hung")


def explicit_error(attempt: RequestRecord) -> bool:
    """The service answered this attempt with an error a client can act on."""
    if attempt.status is not None and attempt.status >= 400:
        return True
    return (attempt.error or "").startswith("stream error")


def _end_s(attempt: RequestRecord) -> float | None:
    if attempt.sent_s is None or attempt.e2e_s is None:
        return None
    return attempt.sent_s + attempt.e2e_s


@dataclass(frozen=True)
class UserRecord:
    """A user's arrival, their client's attempts in order, and how the client ended."""

    index: int
    client: str
    scheduled_s: float
    request_class: str
    tenant: str
    patience_s: float
    attempts: tuple[RequestRecord, ...] = field(default_factory=tuple)
    hung: bool = False
    final_error: str | None = None  # what the client raised or gave up with, if anything

    def __post_init__(self) -> None:
        if self.patience_s <= 0:
            raise ValueError(f"patience_s must be > 0, got {self.patience_s}")

    @property
    def num_attempts(self) -> int:
        return len(self.attempts)

    @property
    def answer(self) -> RequestRecord | None:
        """The attempt that completed (a full stream ending in ``[DONE]``), if any."""
        return next((a for a in self.attempts if a.successful), None)

    def ttft_from_arrival_s(self) -> float | None:
        a = self.answer
        if a is None or a.ttft_s is None or a.sent_s is None:
            return None
        return a.sent_s + a.ttft_s - self.scheduled_s

    def end_from_arrival_s(self) -> float | None:
        """When the client stopped: the end of its last attempt, from the arrival."""
        ends = [e for e in map(_end_s, self.attempts) if e is not None]
        return max(ends) - self.scheduled_s if ends else None

    def _within_patience(self, attempt: RequestRecord) -> bool:
        end = _end_s(attempt)
        return end is not None and end - self.scheduled_s <= self.patience_s

    def outcome(self, cls: RequestClass) -> str:
        if self.hung:
            return "hung"
        a = self.answer
        if a is not None and self._within_patience(a):
            ttft = self.ttft_from_arrival_s()
            on_time = ttft is not None and ttft <= cls.ttft_s
            gaps_ok = not a.itl_s or max(a.itl_s) <= cls.itl_s
            return "good" if on_time and gaps_ok else "late"
        if any(explicit_error(x) and self._within_patience(x) for x in self.attempts):
            return "error"
        return "lost"

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in ("index", "client", "scheduled_s", "request_class",
                                           "tenant", "patience_s", "hung", "final_error")}
        d["attempts"] = [json.loads(a.to_json()) for a in self.attempts]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> UserRecord:
        attempts = tuple(RequestRecord.from_dict(a) for a in d.get("attempts") or ())
        kwargs = {k: d[k] for k in ("index", "client", "scheduled_s", "request_class", "tenant",
                                    "patience_s", "hung", "final_error") if k in d}
        return cls(attempts=attempts, **kwargs)
