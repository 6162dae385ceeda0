"""One real Envoy as the clients' entry balancer in front of two ``kvguard proxy`` processes
(``proxy-kill-envoy``'s front): the config Envoy 1.40 accepts, and a SIGKILLed proxy taken out
(no client sees its refused connects) and put back once it is healthy again."""

import json
import subprocess
import time
import urllib.request

import httpx
import pytest

from chaos.envoy_entry import entry_config, entry_stats
from chaos.envoy_front import envoy_binary
from chaos.topology import Topology, TopologySpec

pytestmark = pytest.mark.slow
BODY = {"model": "llama-7b", "prompt": "the quick brown fox", "max_tokens": 4}


def test_the_entry_config_validates_and_never_counts_a_shed_against_a_proxy(tmp_path):
    path = entry_config(tmp_path, listener_port=18011, admin_port=18012,
                        proxy_urls=["http://127.0.0.1:18013", "http://127.0.0.1:18014"])
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = json.loads(path.read_text())
    (cluster,) = config["static_resources"]["clusters"]
    outlier = cluster["outlier_detection"]
    # a 503 from kvguard is a shed: neither 5xx nor gateway-failure ejection may act on it
    assert outlier["enforcing_consecutive_5xx"] == outlier[
        "enforcing_consecutive_gateway_failure"] == 0
    assert outlier["split_external_local_origin_errors"] is True
    (check,) = cluster["health_checks"]
    assert check["http_health_check"]["path"] == "/health"
    assert check["no_traffic_interval"] == check["interval"]
    route = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert "5xx" not in route["retry_policy"]["retry_on"]  # a shed is an answer
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert manager["delayed_close_timeout"] == "0s"  # a cut stream reaches the client at once
    with pytest.raises(ValueError):
        entry_config(tmp_path, listener_port=1, admin_port=2, proxy_urls=[])


def _host_stat(admin_url: str, proxy_url: str, stat: str) -> str:
    host = proxy_url.removeprefix("http://")
    with urllib.request.urlopen(f"{admin_url}/clusters", timeout=5.0) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"proxies::{host}::{stat}::"):
                return line.rpartition("::")[2]
    raise AssertionError(f"no {stat} for {host} in Envoy's /clusters")


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout_s:g} s")
        time.sleep(0.2)


def test_a_killed_proxy_is_taken_out_and_comes_back(tmp_path):
    spec = TopologySpec(num_replicas=1, num_proxies=2, entry_envoy=True)
    with Topology(spec) as fleet, httpx.Client(timeout=60.0, trust_env=False) as client:
        assert fleet.entry_urls == [fleet.envoy.url]
        victim, survivor = fleet.proxy_urls
        admin = fleet.envoy_admin_url
        for _ in range(4):  # round-robin: both proxies serve
            assert client.post(fleet.envoy.url + "/v1/completions", json=BODY).status_code == 200
        assert int(_host_stat(admin, victim, "rq_total")) >= 1
        fleet.proxies[0].kill()
        # every request after the kill is answered (a refused connect is retried on the
        # survivor, and the victim is ejected and then fails its health checks)
        statuses = [client.post(fleet.envoy.url + "/v1/completions", json=BODY).status_code
                    for _ in range(8)]
        assert statuses == [200] * 8
        _wait_for(lambda: "failed_active_hc" in _host_stat(admin, victim, "health_flags"),
                  "marked unhealthy by the health checks")
        served_before = int(_host_stat(admin, victim, "rq_total"))
        fleet.proxies[0].restart()
        _wait_for(lambda: "failed_active_hc" not in _host_stat(admin, victim, "health_flags"),
                  "healthy again in Envoy's view")

        def victim_served() -> bool:  # Envoy's balancer takes it back a moment after the flag
            assert client.post(fleet.envoy.url + "/v1/completions", json=BODY).status_code == 200
            return int(_host_stat(admin, victim, "rq_total")) > served_before

        _wait_for(victim_served, "back in rotation")
        assert int(_host_stat(admin, survivor, "rq_total")) >= 8
        stats = entry_stats(admin, tmp_path / "stats.txt")
        assert stats["health_check.failure"] + stats["health_check.network_failure"] >= 1
        assert "cluster.proxies.upstream_rq_total" in (tmp_path / "stats.txt").read_text()
