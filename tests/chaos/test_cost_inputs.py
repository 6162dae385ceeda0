"""Reading cost accounting's inputs: step traces, guard traces, client records, windows."""

import pytest

from chaos.cost_cli import split_windows
from chaos.cost_inputs import (
    fates_from_guard_trace,
    fates_from_records,
    read_jsonl,
    steps_from_lines,
)
from chaos.records import RequestRecord
from policies.cost import RequestClass


def test_a_line_cut_by_a_killed_writer_is_skipped_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"source": "engine_step", "batch_id": 1, "start_s": 1.0, "end_s": 1.5, '
                    '"work": [["a", 4, 0, 0, 0]]}\n{"source": "engine_st')
    (step,) = steps_from_lines(read_jsonl(path), "r0")
    assert (step.replica_id, step.start_s, step.end_s, step.work[0].num_prefill_tokens) == \
        ("r0", 1.0, 1.5, 4)
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="steps.jsonl:2"):
        read_jsonl(path)


def test_guard_outcomes_map_to_fates_under_the_upstream_id():
    lines = [
        {"source": "guard", "request_id": "g1", "upstream_request_id": "u1", "arrival_s": 1.0,
         "outcome": "completed", "met_slo": True, "class": "interactive", "tenant": "acme"},
        {"source": "guard", "request_id": "g2", "upstream_request_id": "u2", "arrival_s": 2.0,
         "outcome": "completed", "met_slo": False, "class": "interactive", "tenant": "acme"},
        {"source": "guard", "request_id": "g3", "upstream_request_id": None, "arrival_s": 3.0,
         "outcome": "rejected", "met_slo": False, "class": "batch", "tenant": "beta"},
        {"source": "guard", "request_id": "g4", "upstream_request_id": "u4", "arrival_s": 4.0,
         "outcome": "canceled", "met_slo": False, "class": None, "tenant": "acme"},
        {"source": "engine", "request_id": "u1"},
    ]
    fates = fates_from_guard_trace(lines, {"u1": 7})
    assert [(f.request_id, f.fate, f.request_class, f.num_output_tokens) for f in fates] == [
        ("u1", "good", "interactive", 7), ("u2", "late", "interactive", 0),
        ("g3", "rejected", "batch", 0), ("u4", "canceled", "-", 0)]


def test_client_records_are_judged_strictly_and_placed_on_the_run_clock():
    cls = RequestClass("interactive", 1.0, 0.1)
    good = RequestRecord(0, "interactive", "t", 8, 4, 0.5, 0.5, "completed", 200, ttft_s=0.2,
                         itl_s=(0.05, 0.05), num_tokens_received=3, saw_done=True,
                         request_id="r0")
    late = RequestRecord(1, "interactive", "t", 8, 4, 1.0, 1.0, "completed", 200, ttft_s=0.2,
                         itl_s=(0.05, 0.3), num_tokens_received=3, saw_done=True)
    fates = fates_from_records([good, late], {"interactive": cls}, t0_s=100.0)
    assert [(f.request_id, f.fate, f.arrival_s, f.num_output_tokens) for f in fates] == [
        ("r0", "good", 100.5, 3), ("client-1", "late", 101.0, 3)]


def test_split_windows():
    assert [(w.start_s, w.end_s) for w in split_windows(0.0, 25.0, 10.0)] == \
        [(0.0, 10.0), (10.0, 20.0), (20.0, 25.0)]
    assert len(split_windows(0.0, 25.0, None)) == 1
    with pytest.raises(ValueError, match="--interval"):
        split_windows(0.0, 1.0, 0.0)
