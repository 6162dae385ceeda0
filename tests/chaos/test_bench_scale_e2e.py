"""``kvguard bench scale --e2e-rate``: the plan each fleet is offered (same offered ÷ C, wall
rates ÷ the time scale), flags refused by name, and a small real run through a real proxy and
real state-only replicas whose JSON has one row per fleet, every request answered."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from chaos.bench import scale, scale_e2e


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    return parser.parse_args(list(argv))


def test_each_fleet_gets_the_same_load_relative_to_its_capacity():
    plan = scale_e2e.plan(parse("--e2e-rate", "2000", "--e2e-replicas", "4,256",
                                "--time-scale", "40", "--e2e-duration", "4",
                                "--e2e-warmup", "2", "--e2e-min-requests", "250"))
    small, large = plan["fleets"]
    assert (small["replicas"], large["replicas"]) == (4, 256)
    assert large["offered_gpu_rps"] == 2000 and large["wall_rate_rps"] == 50
    assert small["offered_gpu_rps"] == 2000 * 4 / 256
    assert small["wall_rate_rps"] == pytest.approx(2000 * 4 / 256 / 40)
    assert large["duration_wall_s"] == 160 and large["warmup_wall_s"] == 80
    assert small["duration_wall_s"] == pytest.approx(250 / small["wall_rate_rps"])  # longer
    c = plan["c_per_replica_gpu_rps"]
    assert 1 < c < 100 and plan["offered_over_c"] == pytest.approx(2000 / (256 * c))


@pytest.mark.parametrize("argv, flag", [
    (("--e2e-rate", "10", "--e2e-replicas", "4,x"), "--e2e-replicas"),
    (("--e2e-rate", "10", "--e2e-replicas", "0"), "--e2e-replicas"),
    (("--e2e-rate", "10", "--time-scale", "0"), "--time-scale"),
    (("--e2e-rate", "10", "--e2e-warmup", "5", "--e2e-duration", "5"), "--e2e-warmup"),
    (("--e2e-rate", "10", "--e2e-prompt-tokens", "many"), "many"),
])
def test_bad_end_to_end_flags_are_refused_before_anything_starts(argv, flag):
    with pytest.raises(ValueError, match=flag):
        scale_e2e.plan(parse(*argv))


def test_end_to_end_flags_without_a_rate_are_refused():
    with pytest.raises(ValueError, match="--time-scale applies only with --e2e-rate"):
        scale.run(parse("--replicas", "2", "--time-scale", "5"))


@pytest.mark.slow
def test_a_small_run_answers_every_request_and_reports_each_fleet(tmp_path, capsys):
    args = parse("--e2e-rate", "16", "--e2e-replicas", "1,2", "--time-scale", "2",
                 "--e2e-duration", "2", "--e2e-warmup", "0.5", "--e2e-min-requests", "12",
                 "--e2e-prompt-tokens", "256", "--e2e-output-tokens", "4",
                 "--e2e-out", str(tmp_path), "--json")
    assert scale.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((tmp_path / "e2e.json").read_text())
    assert report["time_scale"] == 2 and report["rate_gpu_rps"] == 16
    assert [f["replicas"] for f in report["fleets"]] == [1, 2]
    for fleet in report["fleets"]:
        assert fleet["offered"] >= 12
        assert fleet["answered_200_429_503"] == fleet["offered"] == sum(
            fleet["statuses"].get(s, 0) for s in ("200", "429", "503"))
        assert fleet["admitted"] > 0 and fleet["proxy_cores"] >= 0
        assert fleet["ttft_p50_s"] is not None and fleet["goodput_over_c"] >= 0
        for key in ("shed_p50_ms", "shed_p99_ms", "gap_p99_s", "good_over_offered",
                    "window_offered_over_c", "fleet_cores", "loadgen_cpu_percent",
                    "loadgen_warnings"):
            assert key in fleet
    assert report["fleets"][0]["goodput_over_c_vs_first"] == 1.0


def test_the_guards_durations_of_engine_time_are_scaled_with_the_replicas(tmp_path):
    from guard.config import GuardConfig, load_config
    from policies.slo import SloPolicy

    args = parse("--e2e-rate", "10", "--time-scale", "60")
    config = load_config(scale_e2e.guard_config(str(tmp_path / "guard.toml"), args))
    slo = SloPolicy()
    interactive = next(c for c in config.classes if c.name == "interactive")
    assert interactive.ttft_s == 60 and config.refresh_interval_s == 6
    assert config.max_queue_wait_s == GuardConfig.max_queue_wait_s * 60  # 30 GPU s, not 0.5
    assert config.policy_params["pressure_hold_s"] == slo.pressure_hold_s * 60
    assert config.policy_params["stale_queue_s"] == slo.stale_queue_s * 60


def test_the_generator_may_hold_every_request_the_offered_rate_keeps_in_flight():
    # Little's law, whatever the time scale: 3,000 req/s of requests that live up to 1 s +
    # 32 x 80 ms is ~10,700 in flight; a fixed cap of 4,096 held requests back unsent
    args = parse("--e2e-rate", "3000", "--time-scale", "60")
    assert scale_e2e.client_connections(3000, args) == math.ceil(3000 * (1 + 32 * 0.08))
    assert scale_e2e.client_connections(3000, parse("--e2e-rate", "3000")) == \
        scale_e2e.client_connections(3000, args)
    assert scale_e2e.client_connections(10, args) == 4096  # never below the old floor


def test_max_in_flight_counts_requests_sent_and_not_yet_ended():
    from chaos.records import RequestRecord

    def rec(i, sent_s, e2e_s):
        return RequestRecord(i, "interactive", "t", 8, 4, sent_s, sent_s, "completed",
                             status=200, e2e_s=e2e_s)
    records = [rec(0, 0.0, 10.0), rec(1, 1.0, 2.0), rec(2, 2.5, 1.0), rec(3, 20.0, 1.0)]
    assert scale_e2e.max_in_flight(records) == 3
