"""Fallback endpoints and the served-endpoint report through a real Envoy: ``kvguard epp
--fallbacks 1`` names the next replica after its pick, Envoy's override-host load balancing
(deploy/envoy/override-host.yaml) retries a replica that refuses the connection on it, reports
the one that served in ``envoy.lb`` metadata, and the EPP moves the request there."""

import json
import re

import pytest
from epp_helpers import BODIES, endpoints, metric, until, write_config

from chaos.envoy_front import envoy_child, epp_child, epp_metrics_url
from chaos.ports import free_port
from tests.support.fleet_cli import fleet_cli

pytestmark = pytest.mark.slow

# round_robin with no state polled: every replica, the dead one too, takes its turn; the dead
# one is never ejected here, so it keeps being picked
ROUND_ROBIN = """
policy = "round_robin"
allow_anonymous = true
[proxy]
eject_after_failures = 1000
"""


def _retries(client, envoy, directory) -> int:
    """Envoy's count of retried upstream requests to the replicas (its admin stats)."""
    config = json.loads((directory / f"envoy-{envoy.port}.json").read_text())
    admin = config["admin"]["address"]["socket_address"]["port_value"]
    text = client.get(f"http://127.0.0.1:{admin}/stats",
                      params={"filter": r"^cluster\.replicas\.upstream_rq_retry$"}).text
    match = re.search(r"cluster\.replicas\.upstream_rq_retry: (\d+)", text)
    return int(match.group(1)) if match else 0


def test_a_refused_pick_is_served_by_its_fallback_and_the_epp_follows_it(
        fleet, client, tmp_path_factory):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    urls = [f"http://{dead}", *fleet.replica_urls]
    by_id = {"r0": dead} | {f"r{i + 1}": e for i, e in enumerate(endpoints(fleet).values())}
    config = write_config(tmp_path_factory, ROUND_ROBIN, "round-robin.toml")
    directory = tmp_path_factory.mktemp("envoy-fallback")
    epp = epp_child(urls, config=config,
                    extra_args=("--state-source", "none", "--fallbacks", "1")).start(60)
    try:
        envoy = envoy_child([epp.port], directory,
                            fallback_replicas=[u.removeprefix("http://") for u in urls]).start(60)
        try:
            before = _retries(client, envoy, directory)
            served = []
            for i in range(6):
                body = {**BODIES["/v1/completions"], "stream": i % 2 == 1}
                response = client.post(envoy.url + "/v1/completions", json=body)
                assert response.status_code == 200, response.text
                upstream = response.headers["x-envoy-upstream-host"]
                # the EPP's replica is where Envoy really sent it, fallback or not
                assert by_id[response.headers["x-kvguard-replica"]] == upstream
                served.append(upstream)
            assert dead not in served
            # round robin over 3 picked the dead replica twice in 6: both retried on its fallback
            assert _retries(client, envoy, directory) - before >= 2
            metrics = epp_metrics_url(epp)
            assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
        finally:
            envoy.close()
    finally:
        epp.close()


# no state poll notices the killed replica in time, and one failure does not eject it: the EPP
# keeps picking it, so only the fallback saves those requests
BLIND = """
policy = "slo"
refresh_interval_s = 5.0
[proxy]
eject_after_failures = 1000
"""


def test_kvguard_fleet_with_fallbacks_serves_what_a_killed_replica_cannot(
        client, tmp_path_factory):
    import os
    import signal

    config = write_config(tmp_path_factory, BLIND, "blind.toml")
    with fleet_cli("--replicas", "2", "--proxies", "1", "--front", "envoy", "--fallbacks", "1",
                   "--proxy-config", config) as (proc, lines):
        by_name = {fields[0]: fields for fields in lines}
        url, live = by_name["envoy"][1], by_name["replica-1"][1].removeprefix("http://")
        os.kill(int(by_name["replica-0"][3]), signal.SIGKILL)
        answers = [client.post(url + "/v1/completions", json=BODIES["/v1/completions"])
                   for _ in range(6)]
        assert [a.status_code for a in answers] == [200] * 6, [a.text[:80] for a in answers]
        assert all(a.headers["x-envoy-upstream-host"] == live for a in answers)
        assert all(a.headers["x-kvguard-replica"] == "r1" for a in answers)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
