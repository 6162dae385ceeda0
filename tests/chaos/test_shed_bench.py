"""The shed bench's arithmetic (pure): counts, shed latencies, the loop-lag metric."""

import pytest

from chaos.records import RequestRecord, classify_outcome
from chaos.shed_bench import loop_lag_max_s, render, shed_row


def rec(index, status, e2e_s):
    saw_done = status == 200
    error = None if saw_done else ("timeout" if status is None else f"HTTP {status}")
    return RequestRecord(index=index, request_class="interactive", tenant="t",
                         num_prompt_tokens=8, max_tokens=3, scheduled_s=0.0, sent_s=0.0,
                         outcome=classify_outcome(status, error, saw_done, status is None),
                         status=status, error=error, e2e_s=e2e_s, saw_done=saw_done)


def test_shed_row_counts_answers_and_takes_shed_latency_percentiles():
    records = [rec(0, 200, 1.5), rec(1, 503, 0.002), rec(2, 503, 0.004), rec(3, 429, 0.006),
               rec(4, None, None)]
    row = shed_row(records, rate=5.0, duration_s=1.0)
    assert (row["offered"], row["answered"], row["admitted"], row["shed"], row["no_answer"]) \
        == (5, 4, 1, 3, 1)
    assert row["shed_p50_s"] == pytest.approx(0.004) and row["shed_max_s"] == 0.006
    row["loop_lag_max_s"] = 0.012
    assert "| 1 | 4.0 | 6.0 | 6.0 | 12.0 |" in render(row)  # no answer, p50, p99, max, lag


def test_loop_lag_is_read_from_the_guard_metrics():
    text = "# HELP x\nkvguard_event_loop_lag_max_seconds 0.0375\nother 1\n"
    assert loop_lag_max_s(text) == pytest.approx(0.0375)
    assert loop_lag_max_s("nothing here") is None
