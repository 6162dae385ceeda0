"""The run summary (``summary.json``): a pure function of the records and the run's numbers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from chaos.goodput import Window, goodput
from chaos.load import LoadResult
from chaos.records import OUTCOMES, RequestRecord
from chaos.stats import distribution
from policies.cost import RequestClass

__all__ = ["outcome_counts", "latency_summary", "reconcile", "build_summary"]


def _error_kind(record: RequestRecord) -> str:
    err = record.error or ""
    if err.startswith("HTTP "):
        return f"HTTP {record.status}"
    return err.split(":", 1)[0].split(" after ", 1)[0] or "unknown"


def outcome_counts(records: list[RequestRecord]) -> dict:
    """offered, each outcome, and why requests were rejected / failed / canceled."""
    by = Counter(r.outcome for r in records)
    rejected = Counter(f"{r.status} {r.reason or '-'}" for r in records if r.outcome == "rejected")
    failed = Counter(_error_kind(r) for r in records if r.outcome == "failed")
    canceled = Counter(_error_kind(r) for r in records if r.outcome == "canceled")
    return {
        "offered": len(records), **{o: by.get(o, 0) for o in OUTCOMES},
        "truncated": sum(r.truncated for r in records),
        "rejected_by": dict(sorted(rejected.items())),
        "failed_by": dict(sorted(failed.items())),
        "canceled_by": dict(sorted(canceled.items())),
    }


def latency_summary(records: list[RequestRecord]) -> dict:
    """TTFT, every inter-token gap, per-request TPOT and end-to-end, over completed requests."""
    done = [r for r in records if r.successful]
    return {
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": distribution([g for r in done for g in r.itl_s]),
        "tpot_s": distribution([sum(r.itl_s) / len(r.itl_s) for r in done if r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "queue_ms": distribution([r.queue_ms for r in records if r.queue_ms is not None]),
    }


def reconcile(client: Mapping[str, int], server: Mapping[str, int] | None) -> dict | None:
    """Per-outcome client vs server counts, and whether they agree.

    ``matches`` is exact agreement. ``explained`` accepts the disagreements a client-side
    cancel (timeout, drain deadline) causes and nothing else: the server may never have seen
    the request (``num_canceled_unseen``), or may have finished, rejected or failed it in the
    same instant (``num_canceled_but_settled``) — but every request the client saw settle must
    have settled the same way at the server.
    """
    if server is None:
        return None
    rows = {o: {"client": client[o], "server": server[o]} for o in ("offered", *OUTCOMES)}
    unseen = client["offered"] - server["offered"]
    settled = {o: server[o] - client[o] for o in ("completed", "rejected", "failed")}
    explained = unseen >= 0 and all(d >= 0 for d in settled.values()) and \
        unseen + sum(settled.values()) + server["canceled"] == client["canceled"]
    return {"kind": server.get("kind"), "by_outcome": rows,
            "matches": all(v["client"] == v["server"] for v in rows.values()),
            "explained": explained, "num_canceled_unseen": unseen,
            "num_canceled_but_settled": settled}


def build_summary(result: LoadResult, *, declared_rate_per_s: float, shape: str,
                  classes: Mapping[str, RequestClass], window: Window,
                  server: Mapping | None = None,
                  declared_mean_rate_per_s: float | None = None) -> dict:
    """Everything ``summary.json`` holds; ``server`` is the metrics block (or None).

    ``declared_rate_per_s`` is the base rate; ``declared_mean_rate_per_s`` the schedule's
    expected mean over the whole duration (differs from the base rate for a burst).
    """
    records = list(result.records)
    counts = outcome_counts(records)
    server_block = dict(server) if server else None
    if server_block is not None:
        server_block["reconcile"] = reconcile(counts, server_block.get("outcomes"))
    return {
        "shape": shape,
        "duration_s": result.duration_s,
        "declared_rate_per_s": declared_rate_per_s,
        "declared_mean_rate_per_s": declared_mean_rate_per_s or declared_rate_per_s,
        "scheduled_rate_per_s": result.scheduled_rate_per_s,
        "achieved_rate_per_s": result.achieved_rate_per_s,
        "rate_shortfall_ratio": result.rate_shortfall_ratio,
        "send_lag_s": result.lag_s(),
        "load_generator": {"wall_s": result.wall_s, "cpu_s": result.cpu_s,
                           "cpu_percent_of_one_core": result.cpu_percent,
                           "cpu_wait_s": result.cpu_wait_s,
                           "gc_pause_max_s": result.gc_pause_max_s,
                           "loop_lag_max_s": result.loop_lag_max_s},
        "warnings": result.warnings(),
        "counts": counts,
        "reconciles": counts["offered"] == sum(counts[o] for o in OUTCOMES),
        "classes": {k: {"ttft_s": c.ttft_s, "itl_s": c.itl_s} for k, c in classes.items()},
        "goodput": goodput(records, classes, window).to_dict(),
        "latency": latency_summary(records),
        "server": server_block,
    }
