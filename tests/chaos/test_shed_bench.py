"""The shed bench: its arithmetic (pure: counts, shed latencies, the loop-lag metric) and the
generator's collector held off during the flood."""

import argparse
import gc

import pytest

from chaos.bench.sheds import loop_lag_max_s, render, shed_row
from chaos.records import RequestRecord, classify_outcome


def rec(index, status, e2e_s, reason=None):
    saw_done = status == 200
    error = None if saw_done else ("timeout" if status is None else f"HTTP {status}")
    return RequestRecord(index=index, request_class="interactive", tenant="t",
                         num_prompt_tokens=8, max_tokens=3, scheduled_s=0.0, sent_s=0.0,
                         outcome=classify_outcome(status, error, saw_done, status is None),
                         status=status, error=error, e2e_s=e2e_s, saw_done=saw_done,
                         reason=reason)


def test_shed_row_counts_answers_and_takes_shed_latency_percentiles():
    records = [rec(0, 200, 1.5), rec(1, 503, 0.002, "slo_unattainable"),
               rec(2, 503, 0.004, "queue_timeout"), rec(3, 429, 0.006, "tenant_budget"),
               rec(4, None, None), rec(5, 503, 0.0005)]
    row = shed_row(records, rate=6.0, duration_s=1.0)
    assert (row["offered"], row["answered"], row["admitted"], row["shed"], row["refused"],
            row["no_answer"]) == (6, 5, 1, 3, 1, 1)
    assert row["shed_p50_s"] == pytest.approx(0.004) and row["shed_max_s"] == 0.006
    row["loop_lag_max_s"] = 0.012
    # refused, no answer, p50, p99, max, lag
    assert "| 1 | 1 | 4.0 | 6.0 | 6.0 | 12.0 |" in render(row)


def test_a_503_without_the_guards_reason_is_a_refused_connection_not_a_shed():
    """The server's connection cap answers 503 before the guard sees the request: its
    (fast) latency must not pass for the guard's."""
    row = shed_row([rec(0, 503, 0.001), rec(1, 503, 0.9, "slo_unattainable")], 2.0, 1.0)
    assert (row["shed"], row["refused"]) == (1, 1)
    assert row["shed_p50_s"] == row["shed_max_s"] == 0.9


def test_loop_lag_is_read_from_the_guard_metrics():
    text = "# HELP x\nkvguard_event_loop_lag_max_seconds 0.0375\nother 1\n"
    assert loop_lag_max_s(text) == pytest.approx(0.0375)
    assert loop_lag_max_s("nothing here") is None


def test_the_replica_runs_on_the_http_server_asked_for():
    import argparse

    from chaos.bench.sheds import configure, engine_args

    parser = argparse.ArgumentParser()
    configure(parser)
    default = engine_args(parser.parse_args([]), "g.toml")
    assert default[default.index("--http") + 1] == "h11"
    ours = engine_args(parser.parse_args(["--http", "kvguard"]), "g.toml")
    assert ours[ours.index("--http") + 1] == "kvguard" and "g.toml" in ours
    bare = engine_args(parser.parse_args([]), None)  # behind kvguard bench proxy's proxy
    assert "--guard" not in bare and bare == [a for a in default if a not in ("--guard", "g.toml")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--http", "nginx"])


def test_the_flood_runs_with_the_generators_collector_off_and_restores_it(monkeypatch, tmp_path):
    from chaos.bench import sheds as shed_bench

    seen = []
    monkeypatch.setattr(shed_bench, "run_once",
                        lambda *a: seen.append(gc.isenabled()) or {"warnings": []})
    assert gc.isenabled()
    assert shed_bench.flood(argparse.Namespace(), 2000.0, tmp_path) == {"warnings": []}
    assert seen == [False] and gc.isenabled()

    def failing(*a):
        raise RuntimeError("the run failed")

    monkeypatch.setattr(shed_bench, "run_once", failing)
    with pytest.raises(RuntimeError):
        shed_bench.flood(argparse.Namespace(), 2000.0, tmp_path)
    assert gc.isenabled()  # back on after a failed run too
