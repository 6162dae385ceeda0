"""The quick chaos scenarios, end to end: real sim replicas, proxies and redis on loopback,
real clients (the OpenAI SDK among them), faults by signal. One run per scenario (always_admit
and slo on the same seeded users), shared by the tests below.

What is asserted does not depend on the machine's speed: every user is accounted for, no
answer that was cut or errored counts as good, every client stays within its retry bound,
over-admission is 0, and no slo client is left hung. Whether slo kept goodput (0 lost, not
worse than always_admit) is asserted only on a valid run — one whose load generator kept its
schedule; on an oversubscribed machine that test is skipped with the generator's own reason,
never passed. Those tests carry ``needs_valid_run``: the session's summary counts their invalid
skips, and a session where every one of them skipped fails (``tests/support/invalid_runs.py``).
"""

import json

import pytest

from chaos.clients import DEFAULT_RETRIES
from chaos.scenario_run import RunSettings
from chaos.scenarios import catalogue, quick_variant
from chaos.user_record import USER_OUTCOMES
from chaos.verdict import THRESHOLDS, slo_vs_always_admit
from tests.support.chaos_quick import quick_scenario_run
from tests.support.invalid_runs import invalid_run_reason

# One scenario run (two fleets) happens inside the first test that needs it: ~1 min on an idle
# 2-core machine, several under heavy contention; the suite's 300 s per-test guard is too short.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_heavy, pytest.mark.exclusive,
              pytest.mark.timeout(900)]
# Each scenario's policies. always_admit runs where the comparison with slo is the point (an
# overload: the burst, the retry storm); under a replica or Redis kill these tests check slo's
# own guarantees (nobody lost, no over-admission, no hung client), and the comparison there
# is the full suite's (`kvguard chaos run replica-kill`), not CI's: each policy's quick run is
# ~27 s of a suite in which nothing else may run beside it.
QUICK = {"burst": ["always_admit", "slo"], "retry-storm": ["always_admit", "slo"],
         "replica-kill": ["slo"], "redis-kill": ["slo"]}
COMPARED = [name for name, policies in QUICK.items() if "always_admit" in policies]


@pytest.fixture(scope="module", params=list(QUICK))
def quick_run(request, tmp_path_factory):
    """One quick run of a scenario (its policies in ``QUICK``), shared by the tests below."""
    return quick_scenario_run(request.param, QUICK[request.param], tmp_path_factory)


def test_every_user_is_accounted_for_and_no_bad_answer_counts(quick_run):
    result, users, out = quick_run
    assert (out / "timeline.png").stat().st_size > 0 and (out / "report.md").exists()
    # the cost section: each policy's run after warm-up and its fault window, from the
    # replicas' step traces; the windows add up
    assert "## Cost" in (out / "report.md").read_text() and (out / "cost.png").stat().st_size > 0
    for policy, verdict in result["policies"].items():
        whole, fault = verdict["cost"]["windows"]
        assert (whole["label"], fault["label"]) == ("after warm-up", "fault window")
        for w in (whole, fault):
            assert w["total_usd"] == pytest.approx(sum(w["components_usd"].values()))
            assert 0 < w["accelerator_busy_usd"] <= w["components_usd"]["accelerator"]
        cls = RunSettings().request_class
        assert whole["num_good"] == sum(  # good users who arrived after the warm-up
            1 for u in users[policy] if u.scheduled_s >= whole["window_s"][0]
            and u.outcome(cls) == "good")
    if quick_variant(catalogue()[result["scenario"]]).proxies <= 1:   # one guard: its trace
        for policy in result["policies"]:
            first = json.loads(open(out / policy / "guard-trace.jsonl").readline())
            assert first["source"] == "guard" and first["decision"] in ("admit", "queue", "shed")
    for policy, verdict in result["policies"].items():
        assert sum(verdict["outcomes"][o] for o in USER_OUTCOMES) == verdict["num_users"]
        for u in users[policy]:
            assert u.num_attempts <= 1 + DEFAULT_RETRIES[u.client], (policy, u)
            answer = u.answer
            if answer is not None:     # an answer is a full stream: [DONE], no error
                assert answer.saw_done and answer.error is None and answer.status == 200
            for a in u.attempts:       # a cut or errored stream is never an answer
                if a.error and ("truncated" in a.error or a.error.startswith("stream error")):
                    assert not a.successful


@pytest.mark.needs_valid_run
def test_no_over_admission_and_no_hung_slo_client(quick_run):
    """Over-admission: 0 with Redis up, whatever the machine's speed. Within 10 % of a window
    while Redis was down, and no hung slo client: both depend on timers running on time (the
    guards' heartbeats divide the local share; a client is hung when it is still inside an
    attempt past its own timeout), so each policy's are judged on its own run when that run
    is valid; when none is, the test is skipped with the generator's own reason, never
    passed."""
    result, _, _ = quick_run
    redis_down = result["scenario"] in ("redis-kill", "redis-hang")
    limits = THRESHOLDS["over_admission_ratio"]
    for verdict in result["policies"].values():
        ratio = verdict["over_admission_ratio"]
        if not redis_down:
            assert ratio is None or ratio <= limits["max_redis_up"], verdict
    valid = {p: v for p, v in result["policies"].items() if not v["generator_warnings"]}
    if not valid:
        pytest.skip(invalid_run_reason(result["policies"]["slo"]["generator_warnings"][0]))
    if "slo" in valid:
        assert valid["slo"]["num_hung"] == 0, valid["slo"]
    for verdict in valid.values():
        ratio = verdict["over_admission_ratio"]
        assert ratio is None or ratio <= limits["max_redis_down"], verdict


@pytest.mark.needs_valid_run
def test_slo_loses_nobody(quick_run):
    """Judged on slo's own run: every slo user got an answer or an explicit error within their
    patience (retry-storm once lost a few, before slo learned each client's patience), within
    the retry bound."""
    result, _, _ = quick_run
    slo = result["policies"]["slo"]
    if slo["generator_warnings"]:
        pytest.skip(invalid_run_reason(slo["generator_warnings"][0]))
    assert slo["attempts_per_user"] <= 1 + max(DEFAULT_RETRIES.values())
    assert slo["num_lost"] == 0, slo["outcomes"]


@pytest.mark.needs_valid_run
@pytest.mark.parametrize("quick_run", COMPARED, indirect=True)
def test_slo_beats_always_admit(quick_run):
    """A comparison: both runs must be valid (a stalled generator makes either one look worse
    than its policy is)."""
    result, _, _ = quick_run
    slo, base = result["policies"]["slo"], result["policies"]["always_admit"]
    invalid = [w for v in (slo, base) for w in v["generator_warnings"]]
    if invalid:
        pytest.skip(invalid_run_reason(invalid[0]))
    # on the users only admission decides (the budgeted tenant's share of its bucket's refill
    # shifts with timing in both runs alike; streams a kill cut mid-way are lost to either
    # policy, and how many sat on the victim is the routing's draw: 16 vs 10 failed CI once),
    # to the no-harm bar: below capacity both serve nearly everyone
    # (A ~0.24 s gap in every stream at once, seen once in replica-kill, was the load
    # generator's own full garbage collection; a ~0.2 s one in redis-kill was its event loop
    # kept off a CPU: a long GC pause or loop lag of the generator makes the run invalid.)
    slo_share, base_share, ok = slo_vs_always_admit(slo, base)
    assert ok, (slo_share, base_share, slo["outcomes"], base["outcomes"])
