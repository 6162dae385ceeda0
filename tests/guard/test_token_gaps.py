"""Gap attribution over fabricated per-token records: exact parts, limits, the CLI table."""

from __future__ import annotations

import json

import pytest

from guard import cli
from guard.observe import timeline
from guard.observe.token_gaps import request_gaps, summarize_delivery, token_stages_s

# [batch_id, step_start_s, step_end_s, handed_s, written_s]; token 2 sat out batch 5 (0.12 s
# from the end of its previous step to the start of its own, 80 ms step) and its hand-off to
# the loop took 30 ms instead of 1 ms.
ENGINE = {"source": "engine", "request_id": "r1", "arrival_s": 0.0, "completion_s": 1.0,
          "tokens": [[3, 10.00, 10.10, 10.101, 10.102],
                     [4, 10.10, 10.20, 10.201, 10.202],
                     [6, 10.32, 10.40, 10.430, 10.432]]}
GUARD = {"source": "guard", "request_id": "r1", "arrival_s": 50.0, "dispatch_s": 50.001,
         "completion_s": 51.0, "chunks_s": [60.103, 60.203, 60.440], "itl_limit_s": 0.15}


def test_per_token_stages_and_exact_gap_parts():
    stages = token_stages_s(ENGINE, GUARD)
    assert stages[2]["between_steps"] == pytest.approx(0.12)
    assert stages[2]["loop"] == pytest.approx(0.03)
    assert [t["relay"] for t in stages] == pytest.approx([0.0, 0.0, 0.007])
    first, second = request_gaps(ENGINE, GUARD)
    assert first.gap_s == pytest.approx(0.1) and first.index == 1
    assert second.gap_s == pytest.approx(0.237)
    parts = second.parts_s
    assert parts["step"] == pytest.approx(0.08) and parts["between_steps"] == pytest.approx(0.12)
    assert parts["loop"] == pytest.approx(0.029) and parts["write"] == pytest.approx(0.001)
    assert parts["relay"] == pytest.approx(0.007)
    assert parts["client"] is None
    assert sum(v for v in parts.values() if v is not None) == pytest.approx(second.gap_s)


def test_without_matching_guard_chunks_the_written_gap_is_attributed():
    guard = dict(GUARD, chunks_s=[60.1])  # chunks do not map onto tokens: no relay stage
    second = request_gaps(ENGINE, guard)[1]
    assert second.gap_s == pytest.approx(10.432 - 10.202) and second.parts_s["relay"] is None


def test_a_client_record_adds_the_client_part():
    client = {"index": 0, "outcome": "completed", "request_id": "r1", "itl_s": [0.1, 0.3]}
    first, second = request_gaps(ENGINE, GUARD, client)
    assert second.gap_s == pytest.approx(0.3)
    assert second.parts_s["client"] == pytest.approx(0.3 - 0.237)
    assert sum(second.parts_s.values()) == pytest.approx(0.3)
    assert first.parts_s["client"] == pytest.approx(0.0)
    assert request_gaps(ENGINE, GUARD, dict(client, itl_s=[0.1]))[1].parts_s["client"] is None


def test_summary_uses_the_class_limit_then_the_default():
    summary = summarize_delivery([(GUARD, ENGINE)], 0.08, timeline.percentile)
    assert summary["num_gaps"] == 2 and summary["num_over_limit"] == 1  # 237 ms > 150 ms
    assert summary["dominant"]["between_steps"] == 1
    assert summary["num_gaps_after_a_step_sat_out"] == 1  # batch 4 -> 6: batch 5 sat out
    assert summary["worst"][0]["num_steps_sat_out"] == 1
    assert summary["over_limit_ms"]["between_steps"] == pytest.approx(120.0)
    assert summary["stages"]["loop"]["max_ms"] == pytest.approx(30.0)
    engine_only = summarize_delivery([(None, ENGINE)], 0.08, timeline.percentile)
    assert engine_only["num_over_limit"] == 2  # 100 ms and 230 ms > 80 ms
    assert summarize_delivery([(GUARD, dict(ENGINE, tokens=None))], 0.08,
                              timeline.percentile) is None


def test_timeline_cli_prints_the_attribution(tmp_path, capsys):
    g, e, c = tmp_path / "g.jsonl", tmp_path / "e.jsonl", tmp_path / "requests.jsonl"
    g.write_text(json.dumps(GUARD) + "\n")
    e.write_text(json.dumps(ENGINE) + "\n")
    c.write_text(json.dumps({"index": 0, "request_id": "r1", "itl_s": [0.1, 0.3]}) + "\n"
                 + json.dumps({"index": 1, "request_id": None, "itl_s": []}) + "\n")
    assert cli.main(["timeline", str(g), str(e)]) == 0
    out = capsys.readouterr().out
    assert "gaps over the limit: 1 of 2" in out and "between_steps" in out
    assert cli.main(["timeline", str(g), str(e), str(c), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_client_records"] == 1 and summary["num_guard_only"] == 0
    assert summary["delivery"]["over_limit_ms"]["client"] == pytest.approx(63.0)
    assert cli.main(["timeline", str(g), str(e), "--itl-limit-ms", "0"]) != 0
    assert "--itl-limit-ms" in capsys.readouterr().err
