"""``/livez``, ``/readyz`` and replicas whose state cannot be read, real processes over
loopback: an unreachable replica is named with the reason in the log, ``/kvguard/state`` and a
metric, and ``/readyz`` is 503 while it is the only replica; a vLLM-shaped replica whose
``/metrics`` lacks ``num_gpu_blocks`` is shown the same way but stays routable."""

import socket
import time

import pytest
from proxy_helpers import proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow


def _until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_an_unreachable_only_replica_is_named_and_the_proxy_not_ready(tmp_path, client):
    with socket.socket() as dead:  # a port nothing answers on
        dead.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        with running(proxy_child([url], write_config(tmp_path), healthy=False)) as proxy:
            assert client.get(proxy.url + "/livez").status_code == 200
            ready = _until(lambda: (r := client.get(proxy.url + "/readyz")).status_code == 503
                           and "state unreadable" in r.text and r)
            assert ready, "readyz never named the unreadable replica"
            reason = ready.json()["reason"]
            assert reason.startswith("no routable replica: r0: state unreadable"), reason
            assert client.get(proxy.url + "/health").status_code == 503  # /health: readiness
            replica = client.get(proxy.url + "/kvguard/state").json()["replicas"][0]
            assert not replica["routable"] and replica["state_error"]
            metrics = client.get(proxy.url + "/kvguard/metrics").text
            assert 'kvguard_proxy_replica_state_readable{replica="r0"} 0.0' in metrics
            assert 'kvguard_proxy_ejections_total{replica="r0"} 0.0' in metrics
            assert "# TYPE kvguard_proxy_ejections_total counter" in metrics  # not a gauge
    lines = [line for line in proxy.output().splitlines() if "state unreadable" in line]
    assert len(lines) == 1 and "replica r0" in lines[0], lines


def test_a_vllm_page_without_capacity_is_shown_and_still_routed(tmp_path, client):
    with running(upstream_child("ok", "m")) as upstream, running(proxy_child(
            [upstream.url], write_config(tmp_path), state_source="vllm")) as proxy:
        replica = _until(lambda: (r := client.get(proxy.url + "/kvguard/state").json()
                                  ["replicas"][0])["state_error"] and r)
        assert replica and "num_gpu_blocks" in replica["state_error"], replica
        assert replica["routable"]
        assert client.get(proxy.url + "/readyz").status_code == 200
        metrics = client.get(proxy.url + "/kvguard/metrics").text
        assert 'kvguard_proxy_replica_state_readable{replica="r0"} 0.0' in metrics


def test_readyz_and_livez_on_a_routable_replica(tmp_path, client):
    with running(upstream_child("ok", "m")) as upstream, running(proxy_child(
            [upstream.url], write_config(tmp_path), state_source="none")) as proxy:
        ready = client.get(proxy.url + "/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ok": True, "draining": False})
        assert client.get(proxy.url + "/livez").json() == {"ok": True}
        replica = client.get(proxy.url + "/kvguard/state").json()["replicas"][0]
        assert replica["state_error"] is None and replica["models"] == ["m"]
