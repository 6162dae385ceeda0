"""Per-user judgement and the verdict's figures on hand-built users: exact values."""

import dataclasses

import pytest

from chaos.records import RequestRecord, classify_outcome
from chaos.user_record import UserRecord
from chaos.verdict import (
    Budget,
    FaultWindow,
    build_verdict,
    cut_by_kill,
    cut_by_replica_kill,
    cut_by_replica_kill_at_gateway,
    good_fraction,
    recovery_s,
    series,
    slo_vs_always_admit,
)
from policies.cost import RequestClass

CLS = RequestClass("interactive", ttft_s=1.0, itl_s=0.1)


def attempt(t_s, *, status=200, ttft_s=0.2, e2e_s=0.5, error=None, saw_done=None,
            canceled=False, itl_s=(0.05,)):
    saw_done = status == 200 and error is None if saw_done is None else saw_done
    return RequestRecord(index=0, request_class="interactive", tenant="t", num_prompt_tokens=8,
                         max_tokens=2, scheduled_s=0.0, sent_s=t_s,
                         outcome=classify_outcome(status, error, saw_done, canceled),
                         status=status, error=error, ttft_s=ttft_s if status == 200 else None,
                         itl_s=itl_s if status == 200 else (), e2e_s=e2e_s, saw_done=saw_done)


def user(t_s, *attempts, client="sdk", patience_s=5.0, hung=False, tenant="t", index=0):
    return UserRecord(index, client, t_s, "interactive", tenant, patience_s, tuple(attempts),
                      hung=hung)


def good(t_s, **kw):
    return user(t_s, attempt(t_s), **kw)


def shed(t_s, **kw):
    return user(t_s, attempt(t_s, status=503, e2e_s=0.01), **kw)


def test_user_is_judged_from_arrival_across_retries():
    assert good(1.0).outcome(CLS) == "good"
    # a shed, then an answer whose own TTFT is fine but 1.5 s after the arrival: late
    retried = user(1.0, attempt(1.0, status=503, e2e_s=0.01), attempt(2.3, ttft_s=0.2))
    assert retried.ttft_from_arrival_s() == pytest.approx(1.5)
    assert retried.outcome(CLS) == "late" and retried.num_attempts == 2
    assert user(1.0, attempt(1.0, itl_s=(0.05, 0.3))).outcome(CLS) == "late"   # one slow gap


def test_errors_lost_and_hung():
    assert shed(1.0).outcome(CLS) == "error"
    stream_err = user(1.0, attempt(1.0, error="stream error: {}", saw_done=False))
    assert stream_err.outcome(CLS) == "error"
    timeout = user(1.0, attempt(1.0, status=None, error="client timeout", canceled=True))
    assert timeout.outcome(CLS) == "lost"
    refused = user(1.0, attempt(1.0, status=None, error="ConnectError: refused"))
    assert refused.outcome(CLS) == "lost"
    truncated = user(1.0, attempt(1.0, saw_done=False, error="stream ended without [DONE]"))
    assert truncated.outcome(CLS) == "lost"
    too_late = user(1.0, attempt(1.0, e2e_s=9.0), patience_s=5.0)          # after patience
    assert too_late.outcome(CLS) == "lost"
    late_503 = user(1.0, attempt(7.0, status=503, e2e_s=0.01), patience_s=5.0)
    assert late_503.outcome(CLS) == "lost"
    assert user(1.0, hung=True).outcome(CLS) == "hung"


def test_user_record_round_trips_json():
    import json
    u = user(1.0, attempt(1.0, status=503, e2e_s=0.01), attempt(2.0), client="tenacity")
    assert UserRecord.from_dict(json.loads(u.to_json())) == u


def _window(**kw):
    base = dict(warmup_s=1.0, start_s=4.0, end_s=6.0, run_end_s=12.0, num_replicas=2,
                num_surviving=1)
    return FaultWindow(**{**base, **kw})


def _users_with_dip(recover_at_s: float):
    """10 users/s: good before 4 s, shed in [4, recover_at_s), good after."""
    users = []
    for i in range(120):
        t = i / 10
        users.append(shed(t, index=i) if 4.0 <= t < recover_at_s else good(t, index=i))
    return users


def test_recovery_is_measured_from_the_fault_end():
    w = _window()
    assert recovery_s(_users_with_dip(6.0), CLS, w, slide_s=2.0) == 0.0
    assert recovery_s(_users_with_dip(7.0), CLS, w, slide_s=2.0) == pytest.approx(1.0)
    assert recovery_s(_users_with_dip(20.0), CLS, w, slide_s=2.0) is None   # never


def test_verdict_figures():
    users = _users_with_dip(5.0)          # in the fault window [4, 6): 10 shed, 10 good
    users[45] = user(4.5, attempt(4.5, status=503, e2e_s=0.01), attempt(4.6), index=45)
    v = build_verdict(users, CLS, _window(), capacity_per_replica_rps=4.0, slide_s=2.0)
    assert v["offered_in_fault_rps"] == pytest.approx(10.0)
    assert v["good_in_fault_rps"] == pytest.approx(5.5)           # 11 good / 2 s
    assert v["surviving_capacity_rps"] == 4.0                     # 1 of 2 replicas × 4
    assert v["goodput_over_surviving_capacity"] == pytest.approx(5.5 / 4.0)
    assert v["num_users"] == 110 and v["outcomes"]["error"] == 9 and v["outcomes"]["good"] == 101
    assert v["attempts_per_user"] == pytest.approx(111 / 110)
    assert v["attempts_per_sdk_user"] == pytest.approx(111 / 110)
    assert v["num_lost"] == 0 and v["num_hung"] == 0 and v["valid"]
    assert v["recovery_s"] == 0.0 and v["over_admission_ratio"] is None
    assert good_fraction(users, CLS, 1.0, 4.0) == 1.0


def test_the_budgeted_tenant_is_left_out_of_what_admission_is_judged_on():
    """Its budget denials and the SDK retries after them are the budget working: they count in
    the outcomes, not in recovery, retry amplification or the good users slo is compared on."""
    free = [good(i / 10, index=i) for i in range(120)]
    # the budgeted tenant: answered until its bucket empties at 5 s, then denied (and retried)
    denied = [user(t, attempt(t, status=429, e2e_s=0.01), attempt(t + 0.5, status=429,
                                                                 e2e_s=0.01))
              for t in (5.0 + i / 10 for i in range(70))]
    budgeted = [dataclasses.replace(u, tenant="b", index=200 + i)
                for i, u in enumerate([good(1.0 + i / 10) for i in range(40)] + denied)]
    budget = Budget("b", requests_per_minute=40, redis_down=False)
    v = build_verdict(free + budgeted, CLS, _window(), 4.0, slide_s=2.0, budget=budget)
    assert v["num_judged_users"] == 110 and v["judged_good"] == 110
    assert v["outcomes"]["error"] == 70 and v["outcomes"]["good"] == 110 + 40
    assert v["recovery_s"] == 0.0 and v["pre_fault_good_fraction"] == 1.0
    assert v["attempts_per_sdk_user"] == 1.0 and v["attempts_per_user"] > 1.0
    unjudged = build_verdict(free + budgeted, CLS, _window(), 4.0, slide_s=2.0)
    assert unjudged["recovery_s"] is None and unjudged["judged_good"] == 150


def test_a_lagging_generator_makes_the_run_invalid():
    v = build_verdict(_users_with_dip(5.0), CLS, _window(), 4.0, slide_s=2.0,
                      generator_warnings=["send lag p99 300 ms"])
    assert not v["valid"] and v["generator_warnings"] == ["send lag p99 300 ms"]


def test_over_admission_against_a_requests_per_minute_bucket():
    users = [good(t / 10, tenant="b", index=t) for t in range(120)]   # 120 answers in 12 s
    budget = Budget("b", requests_per_minute=50, redis_down=True)
    v = build_verdict(users, CLS, _window(), 4.0, slide_s=2.0, budget=budget)
    allowed = 50 * (1 + 11.9 / 60)               # a full bucket + refill by the last answer
    assert v["over_admission_ratio"] == pytest.approx((120 - allowed) / 50)
    ok = build_verdict(users, CLS, _window(), 4.0, slide_s=2.0, budget=Budget("b", 200, False))
    assert ok["over_admission_ratio"] == 0.0


def test_over_admission_is_judged_at_each_answer_not_at_the_schedule_end():
    """Retries answered during the drain (after the 12 s schedule) as the bucket refills are
    within budget; an excess during the run still counts after it is paid back."""
    budget = Budget("b", requests_per_minute=6, redis_down=True)   # one more every 10 s
    paced = [good(0.1 * t, tenant="b", index=t) for t in range(6)] + \
        [good(t, tenant="b", index=t) for t in (10.6, 20.6, 30.6)]
    v = build_verdict(paced, CLS, _window(), 4.0, slide_s=2.0, budget=budget)
    assert v["over_admission_ratio"] == 0.0
    early = [good(0.1 * t, tenant="b", index=t) for t in range(8)] + [good(40.0, tenant="b")]
    v = build_verdict(early, CLS, _window(), 4.0, slide_s=2.0, budget=budget)
    assert v["over_admission_ratio"] == pytest.approx((8 - 6 * (1 + 0.7 / 60)) / 6)


def test_series_bins_attempts_by_send_time():
    users = [user(0.2, attempt(0.2, status=503, e2e_s=0.01), attempt(1.3)), good(1.5)]
    s = series(users, CLS, end_s=2.0, bin_s=1.0)
    assert s["offered_users"] == [1.0, 1.0] and s["attempts"] == [1.0, 2.0]
    assert s["admitted"] == [0.0, 2.0] and s["shed"] == [1.0, 0.0]
    assert s["good_users"] == [0.0, 1.0]


def test_fault_window_is_validated():
    with pytest.raises(ValueError):
        _window(start_s=7.0)
    with pytest.raises(ValueError):
        _window(num_surviving=3)


def test_pre_fault_level_can_end_before_the_judged_window():
    """seed: the burst starts before the replica dies; the level is taken before both."""
    users = [good(i / 10, index=i) if i < 30 else shed(i / 10, index=i) for i in range(120)]
    w = _window(start_s=4.0, pre_end_s=3.0)
    assert build_verdict(users, CLS, w, 4.0, slide_s=2.0)["pre_fault_good_fraction"] == 1.0
    with pytest.raises(ValueError):
        _window(pre_end_s=5.0)


def test_users_refused_for_their_budget_are_not_servable():
    users = _users_with_dip(4.0)                                   # all good
    for i in range(40, 50):                                        # 10 budget refusals in the window
        a = attempt(i / 10, status=429, e2e_s=0.01)
        users[i] = user(i / 10, dataclasses.replace(a, reason="rpm_limit"), index=i)
    v = build_verdict(users, CLS, _window(num_surviving=2), 20.0, slide_s=2.0)
    assert v["offered_in_fault_rps"] == 10.0 and v["offered_within_budget_in_fault_rps"] == 5.0
    assert v["goodput_over_surviving_capacity"] == 1.0


def _cut(t_s, end_s, **kw):
    """A begun stream that broke off at ``end_s`` without [DONE] or an error event."""
    return attempt(t_s, e2e_s=end_s - t_s, saw_done=False,
                   error=kw.pop("error", "RemoteProtocolError: peer closed connection"), **kw)


def test_streams_cut_by_a_proxy_kill_are_lost_and_counted_apart():
    kill_s = 10.0
    cut = user(9.0, _cut(9.0, 10.02), index=1)                  # in flight at the kill
    truncated_later = user(9.0, _cut(9.0, 12.0), index=2)       # broke off 2 s after it
    cut_before = user(8.0, _cut(8.0, 9.5), index=3)             # broke off before it
    after = user(10.5, _cut(10.5, 10.6), index=4)               # sent after the kill
    explicit = user(9.0, attempt(9.0, e2e_s=1.02, error="stream error: {}", saw_done=False),
                    index=5)
    retried = user(9.0, _cut(9.0, 10.02), attempt(10.1, status=None, error="ConnectError"),
                   index=6)                                     # its last attempt was no stream
    users = [cut, truncated_later, cut_before, after, explicit, retried]
    assert [verdict_cut(u, [kill_s]) for u in users] == [True, False, False, False, False,
                                                         False]
    assert not verdict_cut(cut, [])                             # no proxy was killed
    v = build_verdict(users, CLS, _window(), 4.0, slide_s=2.0, proxy_kills_s=[kill_s])
    assert v["num_lost"] == 5 and v["num_cut_by_proxy_kill"] == 1
    assert build_verdict(users, CLS, _window(), 4.0, slide_s=2.0)["num_cut_by_proxy_kill"] == 0
    # each attempt's entry: one through the proxy that lived is not the kill's
    dead, alive = "http://127.0.0.1:1", "http://127.0.0.1:2"
    via = {e: user(9.0, dataclasses.replace(_cut(9.0, 10.02), entry=e), index=7)
           for e in (dead, alive)}
    assert verdict_cut(via[dead], [kill_s], [dead]) and not verdict_cut(via[alive], [kill_s],
                                                                          [dead])
    v = build_verdict([*via.values()], CLS, _window(), 4.0, slide_s=2.0, proxy_kills_s=[kill_s],
                      killed_entries=[dead])
    assert v["num_lost"] == 2 and v["num_cut_by_proxy_kill"] == 1


def verdict_cut(u, kills, killed_entries=()):
    return cut_by_kill(u, CLS, kills, killed_entries)


def _error_event(t_s, end_s):
    """A begun stream the proxy ended at ``end_s`` with an SSE error event."""
    return attempt(t_s, e2e_s=end_s - t_s, saw_done=False,
                   error='stream error: {"code": "upstream_failed"}')


def test_streams_a_replica_kill_cut_are_errors_counted_apart_and_left_out_of_the_share():
    kill_s = 10.0
    cut = user(9.0, _error_event(9.0, 10.3), index=1)              # in flight at the kill
    later = user(9.0, _error_event(9.0, 11.5), index=2)            # error 1.5 s after it
    before = user(8.0, _error_event(8.0, 9.5), index=3)            # error before it
    after = user(10.5, _error_event(10.5, 10.6), index=4)          # sent after the kill
    shed_at_kill = user(9.9, attempt(9.9, status=503, e2e_s=0.2), index=5)
    broke_off = user(9.0, _cut(9.0, 10.02), index=6)               # no error event: lost
    retried = user(9.0, _error_event(9.0, 10.3), attempt(10.4), index=7)   # then late
    users = [cut, later, before, after, shed_at_kill, broke_off, retried]
    assert [cut_by_replica_kill(u, CLS, [kill_s]) for u in users] == [
        True, False, False, False, False, False, False]
    assert not cut_by_replica_kill(cut, CLS, [])
    fine = [good(9.0 + i / 10, index=10 + i) for i in range(3)]
    v = build_verdict([*users, *fine], CLS, _window(end_s=11.0), 4.0, slide_s=2.0,
                      replica_kills_s=[kill_s])
    assert v["outcomes"]["error"] == 5 and v["num_cut_by_replica_kill"] == 1
    assert v["outcomes"]["late"] == 1 and v["judged_good"] == 3
    assert v["judged_good_share_uncut"] == pytest.approx(3 / 9)    # 10 judged, 1 cut
    plain = build_verdict([*users, *fine], CLS, _window(end_s=11.0), 4.0, slide_s=2.0)
    assert plain["num_cut_by_replica_kill"] == 0
    assert plain["judged_good_share_uncut"] == pytest.approx(3 / 10)
    # a proxy kill's cut streams leave the share too
    v = build_verdict([broke_off, *fine], CLS, _window(end_s=11.0), 4.0, slide_s=2.0,
                      proxy_kills_s=[kill_s])
    assert v["judged_good_share_uncut"] == 1.0


def test_slo_vs_always_admit_compares_good_shares_of_the_users_no_kill_cut():
    """The CI run that failed: 286 good vs 293, every error a stream on the killed replica
    (16 vs 10): the shares of the uncut users are 286/287 vs 293/293 — no harm."""
    def v(good_users, cut):
        return {"judged_good": good_users, "judged_good_share_uncut": good_users / (303 - cut)}
    assert slo_vs_always_admit(v(286, 16), v(293, 10))[2]
    assert not slo_vs_always_admit(v(280, 10), v(293, 10))[2]     # 280/293 < 0.98
    assert slo_vs_always_admit(v(288, 10), v(293, 10))[2]         # 288/293 > 0.98
    assert slo_vs_always_admit({"judged_good_share_uncut": None},
                               {"judged_good_share_uncut": None})[2]
    assert not slo_vs_always_admit({"judged_good_share_uncut": None},
                                   {"judged_good_share_uncut": 1.0})[2]


def test_streams_envoy_cut_at_a_replica_kill_stay_lost_and_are_counted_apart_behind_a_gateway():
    """Behind Envoy + kvguard epp a stream whose replica is SIGKILLed breaks off with neither
    [DONE] nor an error event (Envoy resets the client's stream; nothing writes one first): it
    stays lost, counted apart only when the run is behind a gateway, and leaves the share."""
    kill_s = 10.0
    cut = user(9.0, _cut(9.0, 10.02), index=1)                  # in flight at the kill
    later = user(9.0, _cut(9.0, 12.0), index=2)                 # broke off 2 s after it
    before = user(8.0, _cut(8.0, 9.5), index=3)                 # broke off before it
    explicit = user(9.0, _error_event(9.0, 10.3), index=4)      # an error event: an error
    users = [cut, later, before, explicit]
    assert [cut_by_replica_kill_at_gateway(u, CLS, [kill_s]) for u in users] == [
        True, False, False, False]
    fine = [good(9.0 + i / 10, index=10 + i) for i in range(3)]
    window = _window(end_s=11.0)
    v = build_verdict([*users, *fine], CLS, window, 4.0, slide_s=2.0, replica_kills_s=[kill_s],
                      behind_gateway=True)
    assert v["num_lost"] == 3 and v["num_cut_by_replica_kill_at_gateway"] == 1  # lost: unchanged
    assert v["num_cut_by_replica_kill"] == 1                    # the error event's user
    assert v["judged_good_share_uncut"] == pytest.approx(3 / 5)  # 7 judged, 2 cut
    plain = build_verdict([*users, *fine], CLS, window, 4.0, slide_s=2.0,
                          replica_kills_s=[kill_s])           # through kvguard proxy
    assert plain["num_lost"] == 3 and plain["num_cut_by_replica_kill_at_gateway"] == 0
    # a user a proxy kill cut is not counted again
    both = build_verdict([cut, *fine], CLS, window, 4.0, slide_s=2.0, proxy_kills_s=[kill_s],
                         replica_kills_s=[kill_s], behind_gateway=True)
    assert (both["num_cut_by_proxy_kill"], both["num_cut_by_replica_kill_at_gateway"]) == (1, 0)
