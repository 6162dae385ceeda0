"""The quick ``proxy-kill-envoy`` scenario, end to end: 2 sim replicas, 2 kvguard proxies and one
real Envoy as the clients' entry balancer; one proxy SIGKILLed and restarted, under ``slo`` only
(every check below is about the entry, which is the same under any policy; one policy's run
keeps this exclusive test to half a minute of the suite).

What does not depend on the machine's speed: every user is accounted for, every attempt went
through Envoy, no client saw a refused connect, Envoy noticed the kill (an ejection or a failed
health check), and no attempt was answered by Envoy itself (every 503 is a kvguard shed, with
its reason). That nobody was lost but the streams the kill cut is judged on a valid run only
(``needs_valid_run``), like the other chaos quick tests (tests/chaos/test_chaos_quick.py).
"""


import pytest

from chaos.user_record import USER_OUTCOMES
from tests.support.chaos_quick import quick_scenario_run
from tests.support.invalid_runs import invalid_run_reason

pytestmark = [pytest.mark.slow, pytest.mark.cpu_heavy, pytest.mark.exclusive,
              pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return quick_scenario_run("proxy-kill-envoy", ["slo"], tmp_path_factory)


def test_envoy_takes_the_killed_proxy_out_and_answers_nothing_itself(quick_run):
    result, users, out = quick_run
    assert (out / "report.md").exists()
    for policy, verdict in result["policies"].items():
        assert sum(verdict["outcomes"][o] for o in USER_OUTCOMES) == verdict["num_users"]
        entries = {a.entry for u in users[policy] for a in u.attempts if a.entry is not None}
        assert len(entries) == 1, entries  # Envoy is the clients' only entry
        # the clients never met the dead proxy: no refused connect reached them
        assert verdict["generator"]["entry_balancer"]["connect_failures"] == {}
        envoy = verdict["envoy_entry"]
        assert "error" not in envoy, envoy
        noticed = (envoy["outlier_detection.ejections_enforced_total"]
                   + envoy["health_check.failure"] + envoy["health_check.network_failure"])
        assert noticed >= 1, envoy
        assert (out / policy / "envoy-entry-stats.txt").stat().st_size > 0
        for u in users[policy]:
            for a in u.attempts:  # a 5xx that is not kvguard's shed would be Envoy's own
                if a.status is not None and a.status >= 500:
                    assert a.status == 503 and a.reason is not None, (policy, a)


@pytest.mark.needs_valid_run
def test_nobody_is_lost_but_the_streams_the_kill_cut(quick_run):
    """Judged on each policy's own run when it is valid: behind Envoy the only users lost are
    those whose stream was flowing through the proxy when it died."""
    result, _, _ = quick_run
    valid = {p: v for p, v in result["policies"].items() if not v["generator_warnings"]}
    if not valid:
        pytest.skip(invalid_run_reason(result["policies"]["slo"]["generator_warnings"][0]))
    for policy, verdict in valid.items():
        assert verdict["num_lost"] == verdict["num_cut_by_proxy_kill"], (policy, verdict)
        assert verdict["num_hung"] == 0, (policy, verdict)
