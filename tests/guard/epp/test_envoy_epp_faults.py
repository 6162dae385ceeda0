"""Envoy + ``kvguard epp`` when things go away: the EPP down (both ``failure_mode_allow``
settings), SIGTERM drain, two EPPs active-active on Redis with one SIGKILLed, and
``kvguard fleet --front envoy``. Real processes on loopback."""

import signal

import httpx
import pytest
from epp_helpers import (
    BODIES,
    MODEL,
    REPLICA_ARGS,
    endpoints,
    metric,
    until,
    write_config,
)

from chaos.envoy_front import envoy_child, epp_child, epp_metrics_url
from chaos.ports import free_port
from chaos.topology import Topology, TopologySpec
from tests.support.fleet_cli import fleet_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("failure_mode_allow", [False, True])
def test_epp_down_envoy_fails_closed_in_full_duplex_mode(fleet, client, tmp_path,
                                                         failure_mode_allow):
    """With ``FULL_DUPLEX_STREAMED`` bodies Envoy 1.40 fails closed when the EPP cannot be
    reached, whatever ``failure_mode_allow`` says: a 500 (the ext_proc stream failed) or a 503
    (no healthy ext_proc endpoint yet; which one depends on how far Envoy's health checks got),
    never a relay; no request reaches a replica unpicked, and a client's own destination header
    is dropped, not obeyed."""
    envoy = envoy_child([free_port()], tmp_path, failure_mode_allow=failure_mode_allow)
    envoy._health = _answers_at_all
    envoy.start(60)
    try:
        answer = client.post(envoy.url + "/v1/completions", json=BODIES["/v1/completions"],
                             headers={"x-gateway-destination-endpoint":
                                      endpoints(fleet)["r0"]})
        assert answer.status_code in (500, 503), answer.text
        assert "x-envoy-upstream-host" not in answer.headers
    finally:
        envoy.close()


def _answers_at_all(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2.0, trust_env=False)
        return True
    except httpx.HTTPError:
        return False


def test_sigterm_drains_the_epp(fleet, config, client, tmp_path_factory):
    epp = epp_child(fleet.replica_urls, config=config).start(60)
    try:
        envoy = envoy_child([epp.port], tmp_path_factory.mktemp("envoy-drain")).start(60)
        try:
            long = {"model": MODEL, "prompt": "running on", "max_tokens": 40, "stream": True}
            with client.stream("POST", envoy.url + "/v1/completions", json=long) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                epp.proc.send_signal(signal.SIGTERM)

                refused = []

                def shutting_down() -> bool:
                    answer = client.post(envoy.url + "/v1/completions",
                                         json=BODIES["/v1/completions"])
                    refused.append(answer)
                    return answer.status_code == 503
                assert until(shutting_down)
                assert refused[-1].headers["x-kvguard-reason"] == "shutting_down"
                events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"  # the admitted stream ran to its end
            assert epp.proc.wait(timeout=30) == 0
        finally:
            envoy.close()
    finally:
        epp.close()


ACTIVE_ACTIVE = """
policy = "slo"
refresh_interval_s = 0.1
allow_anonymous = true
[budget]
redis_timeout_s = 1.0
heartbeat_s = 0.2
expected_guards = 2
[[tenants]]
name = "acme"
api_key = "k-acme"
requests_per_minute = 10
"""


def test_two_epps_share_budgets_through_redis_and_one_killed_costs_nothing_new(
        client, tmp_path_factory):
    """Active-active: two EPPs behind one Envoy share the tenant budget through Redis (exactly
    the budget is admitted, whichever EPP decides); once one is SIGKILLed the other decides
    every new request: what the kill costs is its in-flight decisions and the one stream Envoy
    sends to it before ejecting it (a 500: Envoy 1.40 does not re-open an ext_proc stream on
    another EPP)."""
    config = write_config(tmp_path_factory, ACTIVE_ACTIVE, "active.toml")
    with Topology(TopologySpec(num_replicas=2, replica_args=REPLICA_ARGS, redis=True)) as fleet:
        epps = [epp_child(fleet.replica_urls, config=config, redis_url=fleet.redis_url).start(60)
                for _ in range(2)]
        try:
            envoy = envoy_child([e.port for e in epps], tmp_path_factory.mktemp("envoy-aa"))
            envoy.start(60)
            try:
                statuses = [client.post(envoy.url + "/v1/completions",
                                        headers={"authorization": "Bearer k-acme"},
                                        json=BODIES["/v1/completions"]).status_code
                            for _ in range(16)]
                assert statuses.count(200) == 10 and statuses.count(429) == 6
                decided = [metric(client, epp_metrics_url(e),
                                   r'kvguard_requests_offered_total\{class="interactive",'
                                   r'tenant="acme"\}') for e in epps]
                assert all(n > 0 for n in decided) and sum(decided) == 16  # both decided
                epps[0].kill()
                after = [client.post(envoy.url + "/v1/completions",
                                     json=BODIES["/v1/completions"]).status_code
                         for _ in range(10)]
                # the first stream sent to the dead EPP fails (500) and ejects it; every
                # later one goes to the live EPP
                assert after.count(500) <= 1 and after.count(200) == 10 - after.count(500)
                assert 500 not in after[2:], after  # round robin: the dead one's turn is early
            finally:
                envoy.close()
        finally:
            for epp in epps:
                epp.close()


def test_kvguard_fleet_front_envoy_serves_through_envoy_and_stops_everything(client):
    import os

    with fleet_cli("--replicas", "2", "--proxies", "2", "--redis", "--front", "envoy") as (
            proc, lines):
        by_name = {fields[0]: fields for fields in lines}
        assert list(by_name) == ["replica-0", "replica-1", "epp-0", "epp-1", "envoy", "redis"]
        answer = client.post(by_name["envoy"][1] + "/v1/completions",
                             json=BODIES["/v1/completions"])
        assert answer.status_code == 200 and answer.headers["x-kvguard-replica"] in ("r0", "r1")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for fields in lines:
            with pytest.raises(ProcessLookupError):
                os.kill(int(fields[3]), 0)


EJECT_FAST = """
policy = "slo"
refresh_interval_s = 5.0   # no state poll notices the dead replica in time: only the passive path
[proxy]
eject_after_failures = 1
probe_interval_s = 0.5
"""


def test_a_replica_envoy_cannot_reach_is_ejected_by_the_epp(client, tmp_path_factory):
    """A killed replica: the request the EPP sent there comes back as Envoy's own 503 (it
    could not connect), which the EPP counts as that replica's failure; ejected, it gets no
    more requests while it is down, and a probe takes it back once it answers again."""
    config = write_config(tmp_path_factory, EJECT_FAST, "eject.toml")
    with Topology(TopologySpec(num_replicas=2, replica_args=REPLICA_ARGS)) as fleet:
        epp = epp_child(fleet.replica_urls, config=config).start(60)
        try:
            envoy = envoy_child([epp.port], tmp_path_factory.mktemp("envoy-eject")).start(60)
            try:
                fleet.replicas[0].kill()
                statuses = [client.post(envoy.url + "/v1/completions",
                                        json=BODIES["/v1/completions"]) for _ in range(8)]
                failed = [r for r in statuses if r.status_code != 200]
                assert len(failed) <= 1, [(r.status_code, r.text[:80]) for r in failed]
                assert all(r.status_code == 503 and "x-kvguard-reason" not in r.headers
                           for r in failed)  # Envoy's own answer, once
                assert all(r.headers["x-kvguard-replica"] == "r1"
                           for r in statuses if r.status_code == 200)
                fleet.replicas[0].restart()
                assert until(lambda: client.post(
                    envoy.url + "/v1/completions", json=BODIES["/v1/completions"],
                    headers={"x-gateway-destination-endpoint-subset":
                             endpoints(fleet)["r0"]}).status_code == 200, timeout_s=30)
            finally:
                envoy.close()
        finally:
            epp.close()
