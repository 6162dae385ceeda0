"""Goodput arithmetic on hand-built records: exact counts for all three variants."""

import pytest

from chaos.goodput import Window, goodput, meets_slo
from chaos.records import RequestRecord, classify_outcome
from policies.cost import RequestClass

CLASSES = {
    "interactive": RequestClass("interactive", ttft_s=1.0, itl_s=0.1),
    "batch": RequestClass("batch", ttft_s=5.0, itl_s=1.0),
}


def rec(index, scheduled_s, *, status=200, saw_done=True, error=None, canceled=False,
        ttft_s=0.5, itl_s=(0.05, 0.05, 0.05), cls="interactive"):
    outcome = classify_outcome(status, error, saw_done, canceled)
    return RequestRecord(index=index, request_class=cls, tenant="t", num_prompt_tokens=8,
                         max_tokens=len(itl_s) + 1, scheduled_s=scheduled_s,
                         sent_s=scheduled_s, outcome=outcome, status=status, error=error,
                         ttft_s=ttft_s, itl_s=tuple(itl_s), e2e_s=1.0, saw_done=saw_done)


ONE_SLOW_GAP = (0.05,) * 99 + (0.5,)            # max 0.5, p99 0.0545, mean 0.0545
SLOW_HALF = (0.15,) * 50 + (0.02,) * 50          # max 0.15, p99 0.15, mean 0.085

RECORDS = [
    rec(0, 1.0),                                           # warm-up: excluded
    rec(1, 2.0),                                           # good everywhere
    rec(2, 3.0, ttft_s=1.5),                               # late first token
    rec(3, 4.0, itl_s=ONE_SLOW_GAP),                       # one slow gap
    rec(4, 5.0, itl_s=SLOW_HALF),                          # only the mean passes
    rec(5, 6.0, status=500, saw_done=False, error="HTTP 500: boom", ttft_s=None, itl_s=()),
    rec(6, 7.0, saw_done=False),                           # truncated stream
    rec(7, 8.0, status=503, saw_done=False, error="HTTP 503", ttft_s=None, itl_s=()),
    rec(8, 9.0, cls="batch", ttft_s=3.0, itl_s=(0.5, 0.5)),  # good under batch limits
    rec(9, 10.0, status=None, saw_done=False, canceled=True, error="timeout", ttft_s=None),
    rec(10, 12.0),                                         # at the window end: excluded
    rec(11, 11.5, itl_s=()),                               # one token: no gap to be late
]


def test_outcomes_of_the_hand_built_records():
    assert [r.outcome for r in RECORDS] == [
        "completed", "completed", "completed", "completed", "completed", "failed", "failed",
        "rejected", "completed", "canceled", "completed", "completed"]
    assert RECORDS[6].truncated and not RECORDS[1].truncated


def test_goodput_counts_for_every_variant_and_class():
    report = goodput(RECORDS, CLASSES, Window(2.0, 12.0))
    total = report.total
    assert (total.num_offered, total.num_successful) == (10, 6)
    assert dict(total.num_good) == {"strict": 3, "p99_gap": 4, "mean_tpot": 5}
    assert total.rate_per_s("strict") == pytest.approx(0.3)
    assert total.ratio("mean_tpot") == pytest.approx(0.5)
    inter, batch = report.per_class["interactive"], report.per_class["batch"]
    assert (inter.num_offered, inter.num_successful) == (9, 5)
    assert dict(inter.num_good) == {"strict": 2, "p99_gap": 3, "mean_tpot": 4}
    assert (batch.num_offered, dict(batch.num_good)) == (
        1, {"strict": 1, "p99_gap": 1, "mean_tpot": 1})


def test_window_excludes_warmup_by_arrival_time():
    with_warmup = goodput(RECORDS, CLASSES, Window(0.0, 12.0)).total
    assert with_warmup.num_offered == 11 and with_warmup.num_good["strict"] == 4
    late_only = goodput(RECORDS, CLASSES, Window(9.0, 20.0)).total
    assert late_only.num_offered == 4          # records 8, 9, 10, 11
    assert late_only.num_good["strict"] == 3


def test_meets_slo_boundaries_are_inclusive():
    cls = CLASSES["interactive"]
    assert meets_slo(rec(0, 0.0, ttft_s=1.0, itl_s=(0.1,)), cls)
    assert not meets_slo(rec(0, 0.0, ttft_s=1.0001, itl_s=(0.1,)), cls)
    assert not meets_slo(rec(0, 0.0, ttft_s=0.2, itl_s=(0.1001,)), cls)


def test_unknown_class_and_bad_window_are_refused():
    with pytest.raises(ValueError, match="no SLO"):
        goodput([rec(0, 1.0, cls="mystery")], CLASSES, Window(0.0, 2.0))
    with pytest.raises(ValueError):
        Window(3.0, 3.0)


def test_record_round_trips_through_json():
    import json
    r = RECORDS[3]
    assert RequestRecord.from_dict(json.loads(r.to_json())) == r
