"""Cost accounting's inputs read from what a run leaves behind: engine step traces
(``kvguard engine --step-trace``), engine and guard request traces, client records.

Engine and guard timestamps are ``time.monotonic()`` of processes on one machine, one clock;
client records count from the load generator's start, so they take that start (``t0_s``) on
the same clock to line up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from chaos.cost import RequestFate, Step, StepWork
from chaos.goodput import meets_slo
from chaos.records import RequestRecord
from policies.cost import RequestClass

__all__ = ["read_jsonl", "steps_from_lines", "fates_from_guard_trace", "fates_from_records",
           "fates_from_users", "output_tokens_from_engine_trace"]


def read_jsonl(path: str | Path) -> list[dict]:
    """Every JSON line of ``path``; ValueError names the file and line of a bad one. A last
    line without its newline is what a writer killed mid-line left: it is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    lines = []
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            lines.append(json.loads(line))
        except ValueError:
            raise ValueError(f"{path}:{number}: not a JSON line") from None
    return lines


def steps_from_lines(lines: Iterable[Mapping], replica_id: str) -> list[Step]:
    """The ``engine_step`` lines of one replica's step trace (other lines are skipped)."""
    steps = []
    for line in lines:
        if line.get("source") != "engine_step":
            continue
        work = tuple(StepWork(str(w[0]), int(w[1]), int(w[2]), int(w[3]), int(w[4]))
                     for w in line["work"])
        start_s = line["start_s"] if line.get("start_s") is not None else line["end_s"]
        steps.append(Step(replica_id, float(start_s), float(line["end_s"]), work))
    return steps


def output_tokens_from_engine_trace(lines: Iterable[Mapping]) -> dict[str, int]:
    """Request id -> output tokens, from ``source: engine`` request lines."""
    return {line["request_id"]: int(line.get("num_output_tokens") or 0) for line in lines
            if line.get("source") == "engine" and line.get("request_id") is not None}


def _guard_fate(line: Mapping) -> str:
    outcome = line.get("outcome")
    if outcome == "completed":
        return "good" if line.get("met_slo") else "late"
    if outcome in ("canceled", "failed"):
        return outcome
    return "rejected" if outcome in ("rejected", "rejected_upstream") else "failed"


def fates_from_guard_trace(lines: Iterable[Mapping],
                           output_tokens: Mapping[str, int] | None = None) -> list[RequestFate]:
    """One fate per guard request line, keyed by the id the engine saw (``upstream_request_id``)."""
    tokens = output_tokens or {}
    fates = []
    for line in lines:
        if line.get("source") != "guard":
            continue
        request_id = line.get("upstream_request_id") or line["request_id"]
        fates.append(RequestFate(str(request_id), float(line["arrival_s"]), _guard_fate(line),
                                 line.get("class") or "-", line.get("tenant") or "-",
                                 tokens.get(request_id, line.get("num_content_chunks") or 0)))
    return fates


def _record_fate(record: RequestRecord, cls: RequestClass) -> str:
    if record.outcome == "completed":
        return "good" if meets_slo(record, cls) else "late"
    return record.outcome


def fates_from_records(records: Iterable[RequestRecord], classes: Mapping[str, RequestClass],
                       t0_s: float = 0.0) -> list[RequestFate]:
    """Client records (strict goodput reading); arrival = ``t0_s`` + ``scheduled_s``. A record
    without a request id (never answered) gets ``client-<index>``: it cost the engine nothing
    that can be traced to it."""
    fates = []
    for r in records:
        request_id = r.request_id or f"client-{r.index}"
        tokens = r.num_tokens_received if r.outcome == "completed" else 0
        fates.append(RequestFate(request_id, t0_s + r.scheduled_s,
                                 _record_fate(r, classes[r.request_class]), r.request_class,
                                 r.tenant, tokens))
    return fates


def fates_from_users(users: Iterable, classes: Mapping[str, RequestClass],
                     t0_s: float = 0.0) -> list[RequestFate]:
    """Chaos users (``chaos.user_record.UserRecord``): one fate per attempt, all at the user's
    arrival. The attempt that answered is good or late as the user was judged (from the
    arrival, patience included); an attempt refused with an HTTP status is rejected; any other
    attempt failed (what it cost an engine is wasted); a user the harness canceled, canceled."""
    fates = []
    for u in users:
        outcome = u.outcome(classes[u.request_class])
        answer = u.answer
        for i, a in enumerate(u.attempts):
            if a is answer and outcome in ("good", "late"):
                fate, tokens = outcome, a.num_tokens_received
            elif a is answer:
                fate, tokens = "late", a.num_tokens_received  # answered after the user gave up
            else:
                fate = "canceled" if u.hung and i == len(u.attempts) - 1 else (
                    "rejected" if a.status is not None and a.status >= 400 else "failed")
                tokens = 0
            fates.append(RequestFate(a.request_id or f"user-{u.index}-{i}", t0_s + u.scheduled_s,
                                     fate, u.request_class, u.tenant, tokens))
    return fates
