"""The cost section every load / bench / chaos report carries (chaos.run_cost, cost_report):
priced from the replicas' step traces, GPU time at the run's GPU kind, or "no cost" said."""

import json

import pytest

from chaos.chaos_report import policy_costs, render_report
from chaos.cost import RequestFate
from chaos.cost_inputs import fates_from_users
from chaos.cost_report import block_section
from chaos.goodput import Window
from chaos.overload import row_costs
from chaos.records import RequestRecord
from chaos.run_cost import gpu_time_prices, priced_windows
from chaos.user_record import UserRecord
from guard.observe.cost_config import CostConfig
from policies.cost import RequestClass


def _step(start_s, end_s, *work):
    return json.dumps({"source": "engine_step", "start_s": start_s, "end_s": end_s,
                       "work": [list(w) for w in work]}) + "\n"


def _traces(tmp_path):
    r0, r1 = tmp_path / "steps-0.jsonl", tmp_path / "steps-1.jsonl"
    r0.write_text(_step(100.5, 101.0, ("a", 64, 0, 0, 0)) + _step(101.0, 101.2, ("a", 0, 1, 64, 0),
                                                                  ("b", 32, 0, 0, 0)))
    r1.write_text(_step(102.0, 103.0, ("c", 128, 0, 0, 0)))
    fates = [RequestFate("a", 100.2, "good", "interactive", "t1", 4),
             RequestFate("b", 100.9, "late", "interactive", "t2", 2),
             RequestFate("c", 101.5, "failed", "batch", "t1", 0)]
    return [r0, r1], fates


def test_windows_add_up_at_gpu_time_prices_of_the_runs_gpu(tmp_path):
    paths, fates = _traces(tmp_path)
    block = priced_windows([("whole", Window(0.0, 4.0)), (None, Window(0.0, 1.0))], 100.0,
                           paths, fates, CostConfig(gpu="a100-80g"), time_scale=2.0)
    assert block["gpu"] == "a100-80g" and block["accelerator_usd_per_gpu_hour"] == 1.99
    whole, first = block["windows"]
    assert whole["label"] == "whole" and "label" not in first
    assert whole["window_s"] == [0.0, 4.0]
    # 2 replicas x 4 wall s at time scale 2 = 4 GPU-seconds at $1.99 per GPU-hour
    assert whole["components_usd"]["accelerator"] == pytest.approx(4 * 1.99 / 3600)
    assert whole["total_usd"] == pytest.approx(sum(whole["components_usd"].values()))
    busy_s = 0.5 + 0.2 + 1.0
    assert whole["accelerator_busy_usd"] == pytest.approx(busy_s / 2 * 1.99 / 3600)
    assert whole["accelerator_busy_usd"] + whole["accelerator_idle_usd"] == pytest.approx(
        whole["components_usd"]["accelerator"], rel=1e-9)
    assert whole["num_good"] == 1 and first["num_good"] == 1
    assert whole["wasted_by_class_usd"].keys() == {"interactive", "batch"}  # b late, c failed


def test_no_step_trace_is_said_not_priced(tmp_path):
    paths, fates = _traces(tmp_path)
    for traces in ([], [paths[0], tmp_path / "absent.jsonl"]):
        block = priced_windows([(None, Window(0.0, 4.0))], 100.0, traces, fates, CostConfig())
        assert block["windows"] == [] and "no engine step trace" in block["unavailable"]
        text = "\n".join(block_section(block))
        assert "## Cost" in text and "No cost for this run: no engine step trace" in text
        assert "|" not in text  # no table with invented numbers
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    block = priced_windows([(None, Window(0.0, 4.0))], 100.0, [empty], fates, CostConfig())
    assert block["windows"] == [] and "no engine step" in block["unavailable"]
    # no traffic at all: a legitimate all-idle window
    idle = priced_windows([(None, Window(0.0, 4.0))], 100.0, [empty], [], CostConfig())
    assert idle["windows"][0]["accelerator_idle_usd"] == pytest.approx(
        idle["windows"][0]["total_usd"])


def test_gpu_time_prices_refuse_a_bad_scale():
    assert gpu_time_prices(CostConfig(), 4.0).accelerator_usd_per_s == pytest.approx(
        3.24 / 3600 / 4)
    with pytest.raises(ValueError, match="time scale"):
        gpu_time_prices(CostConfig(), 0.0)


def _attempt(i, status, outcome, request_id, ttft=0.1, gaps=(0.01,), tokens=3):
    return RequestRecord(i, "interactive", "t", 8, 4, 1.0, 1.0 + 0.01 * i, outcome, status,
                         ttft_s=ttft if outcome == "completed" else None,
                         itl_s=gaps if outcome == "completed" else (), saw_done=outcome == "completed",
                         num_tokens_received=tokens if outcome == "completed" else 0,
                         e2e_s=0.5 if outcome == "completed" else None, request_id=request_id)


def test_chaos_users_give_one_fate_per_attempt_at_the_users_arrival():
    cls = RequestClass("interactive", 1.0, 0.1)
    retried = UserRecord(0, "sdk", 1.0, "interactive", "t", 6.0, attempts=(
        _attempt(0, 503, "rejected", "r0"), _attempt(1, 200, "failed", "r1"),
        _attempt(2, 200, "completed", "r2")))
    late = UserRecord(1, "sdk", 2.0, "interactive", "t", 6.0,
                      attempts=(_attempt(0, 200, "completed", "r3", gaps=(0.5,)),))
    hung = UserRecord(2, "sdk", 3.0, "interactive", "t", 6.0, hung=True,
                      attempts=(_attempt(0, 200, "failed", None),))
    fates = fates_from_users([retried, late, hung], {"interactive": cls}, t0_s=10.0)
    assert [(f.request_id, f.fate, f.arrival_s, f.num_output_tokens) for f in fates] == [
        ("r0", "rejected", 11.0, 0), ("r1", "failed", 11.0, 0), ("r2", "good", 11.0, 3),
        ("r3", "late", 12.0, 3), ("user-2-0", "canceled", 13.0, 0)]


def _window(total, good, label=None):
    w = {"window_s": [0.0, 2.0], "total_usd": total,
         "components_usd": {"accelerator": total, "host": 0.0, "network": 0.0,
                            "idle_reserve": 0.0, "energy": 0.0},
         "accelerator_busy_usd": total / 2, "accelerator_idle_usd": total / 2,
         "num_good": good, "cost_per_good_request_usd": total / good if good else None,
         "cost_per_million_good_output_tokens_usd": None, "wasted_usd": 0.0,
         "wasted_share": 0.0, "wasted_by_class_usd": {}, "wasted_by_tenant_usd": {}}
    return {**w, "label": label} if label else w


def _block(*windows):
    return {"windows": list(windows), "gpu": "h100-80g", "time_scale": 2.0,
            "accelerator_usd_per_gpu_hour": 3.24}


def test_chaos_report_has_a_cost_row_per_policy_and_window():
    verdicts = {"always_admit": {"cost": _block(_window(1e-3, 0, "after warm-up"),
                                                _window(5e-4, 0, "fault window"))},
                "slo": {"cost": _block(_window(1e-3, 10, "after warm-up"))}}
    block = policy_costs(verdicts)
    assert [w["label"] for w in block["windows"]] == [
        "always_admit: after warm-up", "always_admit: fault window", "slo: after warm-up"]
    text = "\n".join(block_section(block))
    assert "| always_admit: after warm-up [0, 2) | $0.001000 |" in text
    assert "| slo: after warm-up [0, 2) |" in text and "| $0.000100 |" in text  # $/good
    assert "h100-80g at $3.24 per GPU-hour" in text
    none = policy_costs({"slo": {"cost": {"windows": [], "unavailable": "no engine step trace"}}})
    assert none["unavailable"] == "slo: no engine step trace"


def test_chaos_report_markdown_carries_the_cost_section():
    from chaos.chaos_report import checks
    from tests.chaos.test_chaos_report import _verdict

    verdicts = {"always_admit": _verdict(20.0), "slo": _verdict(6.0)}
    for v in verdicts.values():
        v["cost"] = _block(_window(1e-3, 5, "after warm-up"))
    result = {"scenario": "burst", "quick": True, "summary": "a burst", "time_scale": 2.0,
              "seed": 0, "capacity_per_replica_rps": 5.0, "capacity_source": "given",
              "fleet_capacity_rps": 10.0, "command": "kvguard chaos run burst", "passed": True,
              "policies": verdicts, "checks": checks(verdicts, 2.0, False)}
    text = render_report(result)
    assert "## Cost" in text and "![cost per window](cost.png)" in text
    assert text.index("## Cost") < text.index("## Load generator")


def test_overload_rows_each_get_a_labelled_window():
    rows = [{"policy": "slo", "load": 1.16, "cost": _block(_window(2e-3, 4))},
            {"policy": "always_admit", "load": 2.0, "cost": _block(_window(2e-3, 0))}]
    block = row_costs(rows)
    assert [w["label"] for w in block["windows"]] == ["slo @ 1.16 C", "always_admit @ 2 C"]
    assert row_costs([{"policy": "slo", "load": 1.0, "cost": None}])["unavailable"] == \
        "slo @ 1 C: no engine step trace"
