"""``kvguard cost`` over the traces of a real guarded sim replica on loopback: the windows'
identities hold and the engine's steps are charged to the guard's requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from guard import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402


@pytest.mark.slow
def test_cost_from_a_guarded_replicas_traces(tmp_path):
    guard_trace, engine_trace = tmp_path / "guard.jsonl", tmp_path / "engine.jsonl"
    steps = tmp_path / "steps.jsonl"
    config = tmp_path / "guard.toml"
    config.write_text(f'policy = "always-admit"\ntrace_path = "{guard_trace}"\n'
                      '[cost]\naccelerator_usd_per_hour = 3.6\nhost_usd_per_hour = 0.36\n'
                      'energy_usd_per_kwh = 0.25\nnetwork_usd_per_gb = 1e9\n')  # $1 a byte
    with start_engine(["--model", "llama-7b", "--backend", "sim", "--guard", str(config),
                       "--trace", str(engine_trace), "--step-trace", str(steps)]) as eng:
        for i in range(4):
            resp = httpx.post(eng.base_url + "/v1/completions", timeout=30, trust_env=False,
                              json={"prompt": [1, 2, 3 + i] * 20, "max_tokens": 8,
                                    "ignore_eos": True})
            assert resp.status_code == 200
    out = tmp_path / "cost"
    assert cli.main(["cost", "--config", str(config), "--guard-trace", str(guard_trace),
                     "--step-trace", str(steps), "--engine-trace", str(engine_trace),
                     "--energy-joules", "3.6e6", "--out", str(out)]) == 0
    (window,) = json.loads((out / "cost.json").read_text())["windows"]
    c = window["components_usd"]
    assert window["total_usd"] == pytest.approx(sum(c.values()), rel=1e-12)
    duration_s = window["window_s"][1] - window["window_s"][0]  # rounded to the µs
    assert c["accelerator"] == pytest.approx(duration_s * 0.001, abs=1e-8)
    assert c["host"] == pytest.approx(2 * duration_s * 0.0001, abs=1e-8)  # 1 replica, 1 guard
    assert c["energy"] == pytest.approx(0.25)  # 1 kWh in the one window
    # network: the bytes on the guard trace's lines, each priced there too
    traced = [json.loads(x) for x in guard_trace.read_text().splitlines()]
    num_bytes = sum(x["num_request_bytes"] + x["num_response_bytes"] for x in traced)
    assert num_bytes > 0 and c["network"] == pytest.approx(num_bytes)
    assert sum(x["network_usd"] for x in traced) == pytest.approx(num_bytes)
    assert 0 < window["accelerator_busy_usd"] < c["accelerator"]
    # good = what the guard judged met its SLO (on a loaded machine a gap may miss it)
    guard_lines = [json.loads(x) for x in guard_trace.read_text().splitlines()]
    num_met = sum(bool(x["met_slo"]) for x in guard_lines)
    assert len(guard_lines) == 4 and window["fates"]["good"] + window["fates"]["late"] == 4
    assert window["num_good"] == num_met and window["num_good_output_tokens"] == 8 * num_met
    if num_met:
        assert window["cost_per_good_request_usd"] == pytest.approx(window["total_usd"] / num_met)
    else:
        assert window["cost_per_good_request_usd"] is None
    assert (window["wasted_usd"] > 0) == (num_met < 4)
    assert (out / "cost.png").stat().st_size > 0 and "## Cost" in (out / "cost.md").read_text()


@pytest.mark.slow
def test_load_report_has_a_cost_section_from_the_step_traces(tmp_path):
    steps = tmp_path / "steps.jsonl"
    out = tmp_path / "run"
    with start_engine(["--model", "llama-7b", "--backend", "sim",
                       "--step-trace", str(steps)]) as eng:
        assert cli.main(["load", "--url", eng.base_url, "--rate", "8", "--duration", "2",
                         "--prompt-tokens", "64", "--output-tokens", "8", "--quiet",
                         "--metrics-url", "none", "--step-trace", str(steps),
                         "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (window,) = summary["cost"]["windows"]
    assert window["window_s"] == [0.0, 2.0]
    assert window["num_good"] == summary["goodput"]["total"]["num_good"]["strict"]
    assert 0 < window["accelerator_busy_usd"] < window["components_usd"]["accelerator"]
    assert "## Cost" in (out / "report.md").read_text() and (out / "cost.png").exists()
