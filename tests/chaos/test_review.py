"""kvguard review: fleet files, the scenario traffic, one real cell, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.review import plot_review, render_markdown
from chaos.review_fleet import FleetSpec, load_fleet
from chaos.review_run import guard_toml, run_cell
from chaos.review_scenarios import PREFIX_TOKENS, ReviewScenario, scenario_matrix, traffic
from chaos.run_cost import gpu_time_prices
from guard.config import load_config
from guard.observe.cost_config import CostConfig
from policies.cost import RequestClass


def test_fleet_file_flags_and_refusals(tmp_path):
    path = tmp_path / "fast.toml"
    path.write_text('replicas = 3\n[engine]\nstep_time_factor = 0.8\nnum_blocks = 500\n'
                    'enable_prefix_caching = false\n[guard]\npolicy = "cap"\n'
                    '[cost]\naccelerator_usd_per_hour = 2.0\n')
    fleet = load_fleet(path)
    assert fleet.name == "fast" and fleet.replicas == 3 and fleet.cost.accelerator_usd_per_s == 2 / 3600
    args = fleet.engine.args(2.0)
    assert args[args.index("--time-scale") + 1] == repr(1.6)
    assert "--no-enable-prefix-caching" in args and args[args.index("--num-blocks") + 1] == "500"
    for text, key in [('[engine]\nbackend = "torch"\n', "engine.backend"),
                      ("[engine]\nstep_time_factor = -1\n", "engine.step_time_factor"),
                      ("[engine]\nblocks = 5\n", "engine.blocks"),
                      ("replica = 2\n", "replica"), ("[cost]\nhost_usd_per_hour = nan\n", "cost.host"),
                      ('[guard]\npolicy = 3\n', "policy")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=key):
            load_fleet(path)


def test_the_same_seed_gives_both_fleets_the_same_traffic():
    steady = scenario_matrix(quick=True)[0].scaled(2.0)
    a, b = traffic(steady, 10.0, 3, "llama-7b"), traffic(steady, 10.0, 3, "llama-7b")
    assert a == b and len(a[0]) > 0
    assert traffic(steady, 10.0, 4, "llama-7b") != a


def test_shared_prefix_traffic_reuses_a_few_system_prompts():
    cache = next(s for s in scenario_matrix(quick=True) if s.shared_prefix)
    _, bodies = traffic(cache, 20.0, 0, "m")
    prefixes = {tuple(json.loads(b)["prompt"][:PREFIX_TOKENS]) for b in bodies}
    assert len(bodies) > 20 and len(prefixes) <= 8


def test_ramp_rises():
    ramp = next(s for s in scenario_matrix(quick=False) if s.ramp_to_load is not None)
    specs, _ = traffic(ramp, 20.0, 0, "m")
    half = ramp.duration_s / 2
    first, second = sum(s.scheduled_s < half for s in specs), sum(s.scheduled_s >= half for s in specs)
    assert second > 1.5 * first


def test_guard_toml_is_a_valid_guard_config(tmp_path):
    path = guard_toml(tmp_path / "g.toml", {"policy": "slo", "max_queue_len": 64,
                                            "policy_params": {"ttft_safety_ratio": 1.1}},
                      RequestClass("interactive", 2.0, 0.16))
    cfg = load_config(path, env={})
    assert cfg.policy == "slo" and cfg.max_queue_len == 64
    assert cfg.request_class("interactive").ttft_s == 2.0
    assert cfg.policy_params["ttft_safety_ratio"] == 1.1


def test_gpu_time_prices():
    cost = gpu_time_prices(CostConfig(accelerator_usd_per_hour=3.6, host_usd_per_hour=0.36), 2.0)
    assert cost.accelerator_usd_per_s == pytest.approx(0.0005)
    assert cost.host_usd_per_s == pytest.approx(0.00005)


@pytest.mark.slow
def test_one_cell_on_a_real_fleet(tmp_path):
    fleet = FleetSpec("one", replicas=2)
    tiny = ReviewScenario("tiny", "a short steady load", 3.0, (1.0, 3.0), load=0.5)
    k = 2.0
    cls = RequestClass("interactive", 1.0 * k, 0.08 * k)
    cell = run_cell(fleet, tiny.scaled(k), 0, 48.0 / k, k, cls, tmp_path)
    assert cell["num_offered"] > 10 and 0 <= cell["goodput_ratio"] <= 1.5  # Poisson arrivals
    cost = cell["cost"]
    assert cost["total_usd"] == pytest.approx(sum(cost["components_usd"].values()))
    assert 0 < cost["accelerator_busy_usd"] <= cost["components_usd"]["accelerator"]
    assert (tmp_path / "steps-0.jsonl").exists() and (tmp_path / "steps-1.jsonl").exists()
    if cell["num_good"]:
        assert cell["cost_per_good_request_usd"] == pytest.approx(cost["total_usd"] / cell["num_good"])


def test_report_renders_verdicts_and_undefined_cells(tmp_path):
    metric = {"verdict": "no significant change", "baseline": [1.0, 0.9, 1.1],
              "candidate": [1.0, 0.9, 1.1], "relative_change": [0.0, -0.1, 0.1], "num_pairs": 2}
    undefined = {"verdict": "no significant change", "baseline": None, "candidate": None,
                 "relative_change": None, "num_pairs": 0}
    report = {"baseline": "a", "candidate": "b", "seeds": 2, "quick": True, "time_scale": 2.0,
              "capacity_gpu_rps": 48.0, "verdict": "no significant change",
              "scenarios": {"steady": {"verdict": "no significant change", "metrics": {
                  "goodput_ratio": metric, "cost_per_good_request_usd": undefined}}}}
    text = render_markdown(report)
    assert "| steady | cost_per_good_request_usd | n/a | n/a | n/a |" in text
    assert "**Overall: no significant change**" in text
    assert Path(plot_review(report, tmp_path / "r.png")).stat().st_size > 0


def _cells(goodput, cost):
    return [{"goodput_ratio": g, "ttft_p90_s": 0.5, "good_tokens_per_s": 100.0 * g,
             "cost_per_good_request_usd": c, "wasted_share": 0.1}
            for g, c in zip(goodput, cost, strict=True)]


def test_rejudge_an_earlier_review(tmp_path):
    from guard import cli

    report = {"baseline": "a", "candidate": "b", "seeds": 3, "quick": True, "time_scale": 2.0,
              "capacity_gpu_rps": 48.0, "scenarios": {
                  "steady": {"description": "", "cells": {
                      "baseline": _cells([0.70, 0.72, 0.71], [1.0, 1.0, 1.0]),
                      "candidate": _cells([0.71, 0.70, 0.72], [1.0, 1.01, 0.99])}},
                  "burst": {"description": "", "cells": {
                      "baseline": _cells([0.80, 0.82, 0.81], [1.0, 1.0, 1.0]),
                      "candidate": _cells([0.50, 0.52, 0.51], [None, 1.6, 1.6])}}}}
    path = tmp_path / "review.json"
    path.write_text(json.dumps(report))
    assert cli.main(["review", "--rejudge", str(path), "--out", str(tmp_path / "again")]) == 1
    judged = json.loads((tmp_path / "again" / "review.json").read_text())
    assert judged["scenarios"]["steady"]["verdict"] == "no significant change"
    assert judged["scenarios"]["burst"]["metrics"]["goodput_ratio"]["verdict"] == "worse"
    assert judged["scenarios"]["burst"]["metrics"]["cost_per_good_request_usd"]["num_pairs"] == 2
    assert judged["verdict"] == "worse"
    assert "**Overall: worse**" in (tmp_path / "again" / "review.md").read_text()
