"""Admitted-request misses and the TTFT forecast error, from records and a guard trace."""

import json

import pytest

from chaos.admission_quality import admitted_misses, forecast_error, gap_attribution
from chaos.records import RequestRecord, classify_outcome
from policies.cost import RequestClass

CLS = RequestClass("interactive", ttft_s=1.0, itl_s=0.1)


def rec(index, status=200, ttft_s=0.5, itl_s=(0.05, 0.05)):
    saw_done = status == 200
    error = None if saw_done else f"HTTP {status}"
    return RequestRecord(index=index, request_class="interactive", tenant="t",
                         num_prompt_tokens=8, max_tokens=3, scheduled_s=float(index),
                         sent_s=float(index),
                         outcome=classify_outcome(status, error, saw_done, False),
                         status=status, error=error, ttft_s=ttft_s if saw_done else None,
                         itl_s=tuple(itl_s), saw_done=saw_done)


def test_gap_misses_are_counted_among_admitted_only():
    records = [rec(0), rec(1, itl_s=(0.05, 0.2)), rec(2, ttft_s=1.5, itl_s=(0.2,)),
               rec(3, status=503), rec(4)]
    assert admitted_misses(records, CLS) == {
        "num_admitted": 4, "missed_share": 0.5, "gap_miss_share": 0.25}
    assert admitted_misses([rec(0, status=503)], CLS)["missed_share"] is None


def test_forecast_error_from_the_guard_trace(tmp_path):
    lines = [
        {"arrival_s": 100.0, "predicted_ttft_s": 0.5, "first_token_s": 101.0},  # 0.5
        {"arrival_s": 101.0, "predicted_ttft_s": 1.0, "first_token_s": 102.0},  # 1.0
        {"arrival_s": 102.0, "predicted_ttft_s": 1.5, "first_token_s": 103.0},  # 1.5
        {"arrival_s": 103.0, "predicted_ttft_s": None, "first_token_s": None},  # a shed
    ]
    path = tmp_path / "guard-trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    e = forecast_error(path)
    assert e["num_samples"] == 3
    assert e["ratio_p50"] == pytest.approx(1.0) and e["ratio_p90"] == pytest.approx(1.4)
    assert e["abs_error_p50"] == pytest.approx(0.5)
    assert forecast_error(path, window_s=(1.0, 5.0))["num_samples"] == 2
    assert forecast_error(tmp_path / "missing.jsonl")["num_samples"] == 0


def test_gap_attribution_counts_over_limit_gaps_by_the_part_that_dominated(tmp_path):
    # Two tokens' gaps: 100 ms (one 100 ms step) and 237 ms (a 120 ms wait between steps
    # dominates an 80 ms step); the class limit in the guard line is 150 ms.
    engine = {"source": "engine", "request_id": "r1", "arrival_s": 0.0, "completion_s": 1.0,
              "tokens": [[3, 10.00, 10.10, 10.101, 10.102], [4, 10.10, 10.20, 10.201, 10.202],
                         [6, 10.32, 10.40, 10.430, 10.432]]}
    guard = {"source": "guard", "request_id": "r1", "arrival_s": 50.0, "dispatch_s": 50.001,
             "completion_s": 51.0, "chunks_s": [60.103, 60.203, 60.440], "itl_limit_s": 0.15}
    paths = []
    for name, line in (("engine.jsonl", engine), ("guard.jsonl", guard)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(line) + "\n")
    assert gap_attribution(paths, 0.08) == {"num_gaps": 2, "num_over_limit": 1,
                                            "num_step": 0, "num_delivery": 1}
    long_step = dict(engine, tokens=[[3, 10.0, 10.1, 10.1, 10.1], [4, 10.1, 10.4, 10.4, 10.4]])
    paths[0].write_text(json.dumps(long_step) + "\n")
    assert gap_attribution(paths, 0.08)["num_step"] == 1  # a 300 ms step: the batch's doing
    assert gap_attribution([tmp_path / "none.jsonl"], 0.08)["num_gaps"] == 0
