"""The overload bench's arithmetic (pure) and the demo end to end (real replicas, loopback)."""

import argparse
import json

import pytest

from chaos.goodput import Window
from chaos.load import LoadResult
from chaos.overload import (
    Scenario,
    configure,
    plan_runs,
    plan_sdk_runs,
    policy_params,
    render_table,
    row_from_run,
)
from chaos.overload_table import add_bare_ratios
from chaos.records import RequestRecord, classify_outcome
from chaos.summary import build_summary
from guard.cli import main as kvguard
from policies.cost import RequestClass


def scenario(*argv: str) -> Scenario:
    p = argparse.ArgumentParser()
    configure(p)
    return Scenario(p.parse_args(list(argv)))


def rec(index, scheduled_s, *, status=200, ttft_s=0.5, itl_s=(0.05, 0.05), tokens=3,
        canceled=False):
    saw_done = status == 200 and not canceled
    error = None if saw_done else ("timeout" if canceled else f"HTTP {status}")
    return RequestRecord(index=index, request_class="interactive", tenant="t",
                         num_prompt_tokens=8, max_tokens=tokens, scheduled_s=scheduled_s,
                         sent_s=scheduled_s, outcome=classify_outcome(status, error, saw_done,
                                                                      canceled),
                         status=status, error=error, ttft_s=ttft_s if saw_done or canceled
                         else None, itl_s=tuple(itl_s), e2e_s=1.0, saw_done=saw_done,
                         num_tokens_received=tokens if status == 200 else 0)


def test_scenario_stretches_every_time_by_the_time_scale():
    s = scenario("--time-scale", "4", "--ttft", "1.0", "--itl", "0.08", "--duration", "10",
                 "--warmup", "2", "--client-timeout", "5")
    assert (s.request_class.ttft_s, s.request_class.itl_s) == (4.0, 0.32)
    assert (s.duration_s, s.warmup_s, s.timeout_s) == (40.0, 8.0, 20.0)
    assert "--time-scale" in s.engine_args() and "4.0" in s.engine_args()
    args = s.load_args("http://127.0.0.1:1", 3.5, __import__("pathlib").Path("/tmp/x"))
    assert (args.rate, args.ttft, args.itl, args.timeout) == (3.5, 4.0, 0.32, 20.0)
    with pytest.raises(ValueError):
        scenario("--time-scale", "0")


def test_token_rate_baseline_is_set_at_the_measured_capacity():
    s = scenario("--prompt-tokens", "100:300", "--output-tokens", "20")
    assert policy_params("token_rate", s, 2.0) == {"tokens_per_minute": int(2.0 * 220 * 60)}
    assert policy_params("slo", s, 2.0) == {}


def test_row_counts_goodput_rejections_and_wasted_tokens_inside_the_window():
    s = scenario("--time-scale", "1", "--ttft", "1.0", "--itl", "0.1")
    records = [
        rec(0, 0.5),                            # warm-up: outside the window
        rec(1, 1.0),                            # good: 3 useful tokens
        rec(2, 2.0, ttft_s=1.5, tokens=5),      # late first token: 5 wasted tokens
        rec(3, 3.0, itl_s=(0.05, 0.4), tokens=4),  # one slow gap: 4 wasted
        rec(4, 4.0, status=503, itl_s=()),      # shed: nothing generated
        rec(5, 5.0, canceled=True, tokens=2),   # client gave up after 2 tokens: wasted
    ]
    result = LoadResult(records=tuple(records), duration_s=6.0, wall_s=6.0, cpu_s=0.1,
                        scheduled_rate_per_s=1.0, achieved_rate_per_s=1.0)
    classes = {"interactive": RequestClass("interactive", 1.0, 0.1)}
    summary = build_summary(result, declared_rate_per_s=1.0, shape="constant",
                            classes=classes, window=Window(1.0, 6.0))
    row = row_from_run(summary, records, s, cap_rps=0.5)
    assert row["goodput_rps"] == pytest.approx(1 / 5)
    assert row["goodput_over_c"] == pytest.approx(0.4)
    assert row["rejected_ratio"] == pytest.approx(1 / 6)
    assert row["canceled_ratio"] == pytest.approx(1 / 6)
    assert row["wasted_tokens"] == 5 + 4 + 2
    assert row["wasted_ratio"] == pytest.approx(11 / 14)
    assert row["ttft_p50_s"] == pytest.approx(0.5)
    # admitted (200) inside the window: 1, 2, 3 and the canceled 5; 3 missed only on a gap
    assert row["num_admitted"] == 4 and row["gap_miss_share"] == pytest.approx(1 / 4)
    table = render_table([{"load": 2.0, "policy": "slo", **row}])
    assert "| 2.00 | slo | 0.20 | 0.40 |" in table


@pytest.mark.slow
def test_demo_runs_end_to_end_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "demo"
    # The demo's own code path at a small size: 4 s wall per run (probe flood, no guard,
    # guard), clients give up after 8 s, so the drains after each run stay short too. What is
    # asserted is that path and the files it writes, not the overload itself.
    rc = kvguard(["demo", "--duration", "1", "--warmup", "0.5", "--time-scale", "4",
                  "--client-timeout", "2", "--prompt-tokens", "256:512",
                  "--output-tokens", "8:16", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| no guard |" in printed and "| kvguard (slo) |" in printed
    result = json.loads((out / "demo.json").read_text())
    assert result["saturation_rps"] > 0
    assert set(result["rows"]) == {"no guard", "kvguard (slo)"}
    for folder in ("no-guard", "guard-slo"):
        summary = json.loads((out / folder / "summary.json").read_text())
        assert summary["reconciles"] and summary["counts"]["offered"] > 0
        assert (out / folder / "timeline.png").stat().st_size > 0
    guarded = json.loads((out / "guard-slo" / "summary.json").read_text())
    assert guarded["server"]["outcomes"]["kind"] == "guard"
    (w,) = guarded["cost"]["windows"]  # one replica's step trace priced the goodput window
    assert w["total_usd"] == pytest.approx(sum(w["components_usd"].values()))
    assert w["accelerator_busy_usd"] > 0 and "## Cost" in (out / "guard-slo" / "report.md").read_text()


def test_plan_runs_puts_bare_next_to_slo_below_capacity_then_every_policy():
    s = scenario("--loads", "1.16,4", "--policies", "always_admit,slo",
                 "--reference-loads", "0.5,0.8")
    assert plan_runs(s.args) == [(0.5, "bare"), (0.5, "slo"), (0.8, "bare"), (0.8, "slo"),
                                 (1.16, "always_admit"), (1.16, "slo"),
                                 (4.0, "always_admit"), (4.0, "slo")]
    none = scenario("--loads", "2", "--policies", "slo", "--reference-loads", "")
    assert plan_runs(none.args) == [(2.0, "slo")]
    for bad in (["--policies", "nope"], ["--loads", "0"], ["--loads", "x"],
                ["--reference-policies", "slo,nope"], ["--loads", ""]):
        with pytest.raises(ValueError):
            plan_runs(scenario(*bad).args)


def test_a_fleet_has_no_bare_row_its_reference_is_the_always_admit_proxy():
    s = scenario("--fleet", "4", "--loads", "2", "--policies", "slo",
                 "--reference-loads", "0.5")
    assert plan_runs(s.args) == [(0.5, "always_admit"), (0.5, "slo"), (2.0, "slo")]
    assert plan_sdk_runs(s.args) == []  # SDK users replay against one replica only
    for bad in (["--policies", "bare"], ["--reference-policies", "bare,slo"]):
        with pytest.raises(ValueError, match="no fleet form"):
            plan_runs(scenario("--fleet", "4", *bad).args)
    with pytest.raises(ValueError, match="one replica only"):
        plan_sdk_runs(scenario("--fleet", "4", "--sdk-loads", "2").args)
    envoy = scenario("--fleet", "2", "--loads", "2", "--reference-loads", "",
                     "--policies", "envoy_adaptive_concurrency,envoy_epp_slo")
    assert plan_runs(envoy.args) == [(2.0, "envoy_adaptive_concurrency"), (2.0, "envoy_epp_slo")]
    with pytest.raises(ValueError, match="unknown"):  # Envoy rows need a fleet
        plan_runs(scenario("--loads", "2", "--policies", "envoy_epp_slo").args)
    breaker = ("--fleet", "2", "--loads", "2", "--reference-loads", "")
    assert plan_runs(scenario(*breaker, "--policies", "envoy_circuit_breaker",
                              "--envoy-max-requests", "40").args) == [
        (2.0, "envoy_circuit_breaker")]
    # the breaker's threshold does nothing without its row, must be a count, and has no default
    for bad in (["--policies", "slo", "--envoy-max-requests", "40"],
                ["--policies", "envoy_circuit_breaker", "--envoy-max-requests", "0"],
                ["--policies", "envoy_circuit_breaker"]):
        with pytest.raises(ValueError, match="--envoy-max-requests"):
            plan_runs(scenario(*breaker, *bad).args)
    rows = [{"load": 2.0, "policy": "always_admit", "goodput_rps": 4.0},
            {"load": 2.0, "policy": "slo", "goodput_rps": 10.0}]
    add_bare_ratios(rows, "always_admit")
    assert [r["goodput_over_always_admit"] for r in rows] == [1.0, 2.5]
    assert "| ÷ always_admit |" in render_table([{**r, "ttft_p50_s": None, "ttft_p99_s": None,
                                                  "goodput_over_c": 1.0, "rejected_ratio": 0.0,
                                                  "canceled_ratio": 0.0, "wasted_tokens": 0,
                                                  "wasted_ratio": 0.0} for r in rows],
                                                "always_admit")


@pytest.mark.slow
def test_fleet_variant_runs_both_proxies_side_by_side(tmp_path, capsys):
    """Tiny scale: 2 sim replicas, a given capacity, one load; both rows in the table."""
    out = tmp_path / "fleet"
    rc = kvguard(["bench", "overload", "--fleet", "2", "--capacity", "3", "--time-scale", "2",
                  "--duration", "2", "--warmup", "0.5", "--client-timeout", "3",
                  "--prompt-tokens", "256:512", "--output-tokens", "8:16", "--loads", "1.5",
                  "--policies", "always_admit,slo", "--reference-loads", "",
                  "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| 1.50 | always_admit |" in printed and "| 1.50 | slo |" in printed
    result = json.loads((out / "overload.json").read_text())
    assert result["capacity_rps"] == 6.0  # 2 replicas x the given 3 req/s
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"always_admit", "slo"}
    assert rows["always_admit"]["goodput_over_always_admit"] == 1.0
    for policy in rows:
        summary = json.loads((out / f"{policy}-1.50" / "summary.json").read_text())
        assert summary["reconciles"] and summary["counts"]["offered"] > 0
        assert summary["server"]["outcomes"]["kind"] == "guard"  # the proxy's counters
    assert (out / "slo-1.50" / "guard-trace.jsonl").stat().st_size > 0  # the proxy's trace
    # the cost section: each row's goodput window from the fleet's step traces, GPU time
    report = (out / "overload.md").read_text()
    assert "## Cost" in report and "| slo @ 1.5 C [" in report and "| always_admit @ 1.5 C [" in report
    assert (out / "cost.png").stat().st_size > 0
    for row in rows.values():
        (w,) = row["cost"]["windows"]
        assert row["cost"]["gpu"] == "h100-80g" and row["cost"]["time_scale"] == 2.0
        assert w["total_usd"] == pytest.approx(sum(w["components_usd"].values()))
        assert 0 < w["accelerator_busy_usd"] <= w["components_usd"]["accelerator"]
        # 2 replicas over the window [1, 4) wall s at time scale 2: 3 GPU-s at $3.24/h
        assert w["window_s"] == [1.0, 4.0]
        assert w["components_usd"]["accelerator"] == pytest.approx(2 * 3.0 / 2 * 3.24 / 3600)


def test_goodput_over_bare_is_taken_at_the_same_load():
    rows = [{"load": 0.5, "policy": "bare", "goodput_rps": 4.0},
            {"load": 0.5, "policy": "slo", "goodput_rps": 3.9},
            {"load": 2.0, "policy": "slo", "goodput_rps": 8.0}]
    add_bare_ratios(rows)
    assert [r["goodput_over_bare"] for r in rows] == [1.0, pytest.approx(0.975), None]


def test_sdk_rows_must_be_planned_rows():
    s = scenario("--loads", "2,4", "--policies", "always_admit,slo", "--sdk-loads", "2",
                 "--sdk-policies", "slo")
    assert plan_sdk_runs(s.args) == [(2.0, "slo")]
    assert plan_sdk_runs(scenario("--sdk-loads", "").args) == []
    with pytest.raises(ValueError, match="do not run"):
        plan_sdk_runs(scenario("--loads", "2", "--sdk-loads", "3").args)


def test_sdk_users_are_summarized_per_user_from_their_arrival():
    from dataclasses import dataclass

    from chaos.sdk_column import summarize_users

    @dataclass
    class User:  # the fields and method of chaos' per-user record that the column reads
        scheduled_s: float
        num_attempts: int
        good: bool

        def outcome(self, cls):
            return "good" if self.good else "error"

    users = [User(0.5, 3, True),  # warm-up: left out
             User(1.0, 1, True), User(2.0, 2, False), User(3.0, 1, True), User(4.0, 1, False)]
    row = summarize_users(users, RequestClass("interactive", 1.0, 0.1), (1.0, 5.0), cap_rps=2.0)
    assert row == {"num_users": 4, "attempts_per_user": 1.25, "goodput_rps": 0.5,
                   "goodput_over_c": 0.25}


def test_prefix_cache_precise_subscribes_the_guard_to_the_replicas_kv_events(tmp_path):
    from chaos.replica import write_guard_config
    from guard.config import load_config

    approximate = scenario("--workload", "shared-prefix")
    assert approximate.guard_settings(tmp_path) == {}
    assert "--kv-events-endpoint" not in approximate.engine_args()
    precise = scenario("--workload", "shared-prefix", "--prefix-cache", "precise")
    engine_args = precise.engine_args()
    assert engine_args[engine_args.index("--kv-events-endpoint") + 1] == "tcp://127.0.0.1:*"
    path = write_guard_config(str(tmp_path / "guard.toml"), policy="slo", ttft_s=4.0,
                              itl_s=0.32, settings=precise.guard_settings(tmp_path))
    config = load_config(path)  # a config the guard accepts: precise needs its tokenizer key
    assert config.prefix_cache == "precise"
    assert config.tokenizer == str(tmp_path / "tokenizer.json")
    with pytest.raises(SystemExit):
        scenario("--prefix-cache", "exact")
