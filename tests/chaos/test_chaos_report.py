"""Checks against thresholds, the report and the timeline from hand-built verdicts."""

from chaos.chaos_report import checks, plot_timelines, render_report, render_table
from chaos.faults import FaultEvent
from chaos.verdict import build_verdict
from tests.chaos.test_verdict import CLS, _users_with_dip, _window

GENERATOR = {"cpu_percent_of_one_core": 20.0, "cpu_wait_s": 0.5, "send_lag_s": {"p99": 0.003},
             "achieved_rate_per_s": 10.0, "scheduled_rate_per_s": 10.0}


def _verdict(recover_at_s, warnings=()):
    v = build_verdict(_users_with_dip(recover_at_s), CLS, _window(num_surviving=2), 5.0,
                      slide_s=2.0, generator_warnings=list(warnings))
    return {**v, "generator": GENERATOR}


def test_checks_hold_slo_to_its_targets_and_compare_with_always_admit():
    verdicts = {"always_admit": _verdict(20.0), "slo": _verdict(6.0)}
    c = checks(verdicts, time_scale=2.0, redis_down=False)
    assert c["slo"]["recovery_s"] == {"value": 0.0, "threshold": "<= 4 s", "pass": True}
    assert c["slo"]["num_lost"]["pass"] and c["slo"]["attempts_per_sdk_user"]["pass"]
    assert c["slo"]["goodput_over_surviving_capacity"]["pass"] is False   # 0 good in the window
    assert "recovery_s" not in c["always_admit"]                           # slo's targets only
    assert c["slo_vs_always_admit"]["pass"]
    bad = checks({"always_admit": _verdict(6.0), "slo": _verdict(20.0, ["lag"])}, 2.0, False)
    assert not bad["slo_vs_always_admit"]["pass"] and not bad["slo"]["valid"]["pass"]


def test_report_lists_every_check_and_the_generator(tmp_path):
    verdicts = {"always_admit": _verdict(20.0), "slo": _verdict(6.0, ["send lag p99 300 ms"])}
    result = {"scenario": "burst", "quick": True, "summary": "a burst", "time_scale": 2.0,
              "seed": 0, "capacity_per_replica_rps": 5.0, "capacity_source": "given",
              "fleet_capacity_rps": 10.0, "command": "kvguard chaos run burst", "passed": False,
              "policies": verdicts, "checks": checks(verdicts, 2.0, False)}
    md = render_report(result)
    assert "| slo | **no** |" in md and "send lag p99 300 ms" in md
    assert "slo.recovery_s: 0.0 (target <= 4 s) pass" in md and "**FAIL**" in md
    assert "entry balancer" not in md                         # nothing was refused
    verdicts["slo"]["generator"] = {**GENERATOR, "entry_balancer": {
        "connect_failures": {"http://127.0.0.1:9": 2}, "failovers": 2, "fail_timeout_s": 10.0}}
    assert "slo: the entry balancer (nginx's defaults" in render_report(result)
    assert "sent 2 refused connect(s) on" in render_report(result)
    events = [FaultEvent(4.0, "rate_step", "rate", "rate up"),
              FaultEvent(6.0, "rate_step", "rate", "rate down")]
    runs = {p: (_users_with_dip(6.0), events, v) for p, v in verdicts.items()}
    path = plot_timelines(runs, CLS, 12.0, 1.0, tmp_path / "t.png", "burst")
    assert path.stat().st_size > 10_000


def test_slo_is_held_to_the_no_harm_bar_against_always_admit():
    """Below capacity both runs serve nearly everyone: one user either way (228 vs 229) is not
    harm; 2 % fewer is."""
    base = _verdict(6.0)
    for slo_good, ok in ((228, True), (229, True), (224, True), (223, False)):
        verdicts = {"always_admit": {**base, "judged_good": 228,
                                     "judged_good_share_uncut": 228 / 230},
                    "slo": {**base, "judged_good": slo_good,
                            "judged_good_share_uncut": slo_good / 230}}
        assert checks(verdicts, 2.0, False)["slo_vs_always_admit"]["pass"] is ok, slo_good


def test_lost_check_leaves_out_only_streams_cut_by_a_proxy_kill():
    base = _verdict(6.0)
    cut_only = {**base, "outcomes": {**base["outcomes"], "lost": 3}, "num_lost": 3,
                "num_cut_by_proxy_kill": 3}
    c = checks({"slo": cut_only}, time_scale=2.0, redis_down=False)["slo"]["num_lost"]
    assert c["pass"] and c["value"] == 3 and "3 stream(s) cut by the proxy kill" in c["threshold"]
    more = {**cut_only, "outcomes": {**base["outcomes"], "lost": 4}, "num_lost": 4}
    assert not checks({"slo": more}, 2.0, False)["slo"]["num_lost"]["pass"]
    assert "| 4 (3 cut by the proxy kill) |" in render_table({"slo": more})


def test_table_counts_streams_a_replica_kill_cut_within_the_errors():
    base = _verdict(6.0)
    cut = {**base, "outcomes": {**base["outcomes"], "error": 5}, "num_cut_by_replica_kill": 4}
    assert "| 5 (4 cut by the replica kill) |" in render_table({"slo": cut})
    assert "cut by the replica kill" not in render_table({"slo": base})


def test_lost_check_names_streams_envoy_cut_at_a_replica_kill_and_keeps_them_in_the_table():
    base = _verdict(6.0)
    cut = {**base, "outcomes": {**base["outcomes"], "lost": 5}, "num_lost": 5,
           "num_cut_by_replica_kill_at_gateway": 5}
    c = checks({"slo": cut}, time_scale=2.0, redis_down=False)["slo"]["num_lost"]
    assert c["pass"] and c["value"] == 5
    assert "5 stream(s) Envoy cut mid-body" in c["threshold"]
    assert "no gateway policy can save them" in c["threshold"]
    assert "| 5 (5 cut by Envoy at the replica kill) |" in render_table({"slo": cut})
    more = {**cut, "outcomes": {**cut["outcomes"], "lost": 6}, "num_lost": 6}
    assert not checks({"slo": more}, 2.0, False)["slo"]["num_lost"]["pass"]
