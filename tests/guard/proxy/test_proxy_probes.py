"""``/livez``, ``/readyz`` and a replica whose state cannot be read, real processes over
loopback: a vLLM-shaped replica whose ``/metrics`` lacks ``num_gpu_blocks`` is named with the
reason in the log, ``/kvguard/state`` and a metric, and ``/readyz`` is 503 while it is the
only replica."""

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


def test_an_unreadable_replica_is_named_and_the_proxy_not_ready(tmp_path, client):
    with running(upstream_child("ok", "m")) as upstream, running(proxy_child(
            [upstream.url], write_config(tmp_path), state_source="vllm",
            healthy=False)) as proxy:
        assert client.get(proxy.url + "/livez").status_code == 200
        ready = _until(lambda: (r := client.get(proxy.url + "/readyz")).status_code == 503 and r)
        assert ready, "readyz never became 503"
        reason = ready.json()["reason"]
        assert "r0" in reason and "num_gpu_blocks" in reason, reason
        assert client.get(proxy.url + "/health").status_code == 503  # /health: readiness
        replica = client.get(proxy.url + "/kvguard/state").json()["replicas"][0]
        assert not replica["routable"]
        assert "num_gpu_blocks" in replica["state_error"]
        metrics = client.get(proxy.url + "/kvguard/metrics").text
        assert 'kvguard_proxy_replica_state_readable{replica="r0"} 0.0' in metrics
        assert 'kvguard_proxy_ejections_total{replica="r0"} 0.0' in metrics
        assert "# TYPE kvguard_proxy_ejections_total counter" in metrics  # not a gauge
    lines = [line for line in proxy.output().splitlines() if "state unreadable" in line]
    assert len(lines) == 1 and "r0" in lines[0] and "num_gpu_blocks" in lines[0], lines


def test_readyz_and_livez_on_a_routable_replica(tmp_path, client):
    with running(upstream_child("ok", "m")) as upstream, running(proxy_child(
            [upstream.url], write_config(tmp_path), state_source="none")) as proxy:
        ready = client.get(proxy.url + "/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ok": True, "draining": False})
        assert client.get(proxy.url + "/livez").json() == {"ok": True}
        replica = client.get(proxy.url + "/kvguard/state").json()["replicas"][0]
        assert replica["state_error"] is None and replica["models"] == ["m"]
