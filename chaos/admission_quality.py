"""How well the guard's admissions turned out, from the client's records and the guard's trace.

* :func:`admitted_misses`: among the requests the server answered 200 (admitted), the share
  that missed their SLO, and the share that met TTFT but missed on an inter-token gap — the
  gaps an admission controller is supposed to protect.
* :func:`forecast_error`: the TTFT forecast against what happened, from the guard's trace
  (``predicted_ttft_s`` and ``first_token_s - arrival_s`` of each admitted request): median and
  p90 of predicted ÷ actual, and the median absolute relative error.
* :func:`gap_attribution`: every inter-token gap over the limit, from the engine's per-token
  trace joined with the guard's trace and the client's records (``kvguard timeline``'s
  attribution), counted by the part that dominated it: the engine step itself (admission's
  business: the batch it built) or delivery (between steps, event loop, write, relay, client).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from chaos.goodput import meets_slo
from chaos.records import RequestRecord
from chaos.stats import percentile
from guard.observe.timeline import join, load_sources
from guard.observe.token_gaps import summarize_delivery
from policies.cost import RequestClass

__all__ = ["admitted_misses", "forecast_error", "gap_attribution"]


def admitted_misses(records: Sequence[RequestRecord], cls: RequestClass) -> dict:
    """``num_admitted``, ``missed_share`` (any SLO miss) and ``gap_miss_share`` (TTFT met,
    some gap over the ITL limit) among the records with status 200."""
    admitted = [r for r in records if r.status == 200]
    missed = [r for r in admitted if not meets_slo(r, cls)]
    gap_missed = [r for r in admitted if r.ttft_s is not None and r.ttft_s <= cls.ttft_s
                  and r.itl_s and max(r.itl_s) > cls.itl_s]
    n = len(admitted)
    return {"num_admitted": n,
            "missed_share": len(missed) / n if n else None,
            "gap_miss_share": len(gap_missed) / n if n else None}


def forecast_error(trace_path: Path | str, window_s: tuple[float, float] | None = None) -> dict:
    """Predicted ÷ actual TTFT over the admitted requests in a guard trace (``window_s``: arrival
    times relative to the first arrival in the trace). Empty figures when nothing qualifies."""
    path = Path(trace_path)
    rows = []
    if path.exists():
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    t0_s = min((r["arrival_s"] for r in rows), default=0.0)
    ratios = []
    for r in rows:
        predicted_s, first_s = r.get("predicted_ttft_s"), r.get("first_token_s")
        if predicted_s is None or first_s is None:
            continue
        if window_s is not None and not window_s[0] <= r["arrival_s"] - t0_s < window_s[1]:
            continue
        actual_s = first_s - r["arrival_s"]
        if predicted_s > 0 and actual_s > 0:
            ratios.append(predicted_s / actual_s)
    return {"num_samples": len(ratios),
            "ratio_p50": percentile(ratios, 50), "ratio_p90": percentile(ratios, 90),
            "abs_error_p50": percentile([abs(x - 1.0) for x in ratios], 50)}


def gap_attribution(paths: Sequence[Path | str], itl_s: float) -> dict:
    """``num_gaps``, ``num_over_limit`` and how many of those the engine step dominated
    (``num_step``) versus delivery (``num_delivery``); zeros without per-token records."""
    existing = [str(p) for p in paths if Path(p).exists()]
    empty = {"num_gaps": 0, "num_over_limit": 0, "num_step": 0, "num_delivery": 0}
    if not existing:
        return empty
    sources = load_sources(existing)
    rows = join(sources["guard"], sources["engine"])
    delivery = summarize_delivery(rows, itl_s, _percentile0, sources["client"])
    if delivery is None:
        return empty
    dominant = delivery["dominant"]
    num_step = dominant.get("step", 0)
    return {"num_gaps": delivery["num_gaps"], "num_over_limit": delivery["num_over_limit"],
            "num_step": num_step, "num_delivery": delivery["num_over_limit"] - num_step}


def _percentile0(values: list[float], q: float) -> float:
    return percentile(values, q) or 0.0
