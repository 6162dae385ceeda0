"""The split Envoy config (``deploy/envoy/envoy-split.yaml``): a real Envoy with a decision
ext_proc filter (request only) and an observer filter (response, observability mode), both to
one real ``kvguard epp``, in front of 2 sim replicas: routing, what the ticket learns through
the observer, disconnects, a forged correlation, and an observer that never comes."""

import json
import re
import signal
import socket
import subprocess
import sys

import pytest
from epp_helpers import BODIES, MODEL, endpoints, metric, until

from chaos.child import ChildProcess
from chaos.envoy_front import (
    SPLIT_CONFIG,
    envoy_binary,
    envoy_child,
    envoy_config,
    epp_child,
    epp_id,
    epp_metrics_url,
)
from chaos.ports import free_port
from chaos.topology import http_health
from tests.support.fleet_cli import fleet_cli

pytestmark = pytest.mark.slow

COMPLETED = r'kvguard_requests_completed_total\{class="interactive",tenant="anonymous"\}'
CANCELED = r'kvguard_requests_canceled_total\{class="interactive",tenant="anonymous"\}'
FAILED = r'kvguard_requests_failed_total\{class="interactive",tenant="anonymous"\}'
LONG = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "stream": True}


@pytest.fixture(scope="module")
def split(fleet, config, tmp_path_factory):
    """(Envoy on the split config, its EPP with one JSON access line per request)."""
    epp = epp_child(fleet.replica_urls, config=config,
                    extra_args=("--access-log", "--log-format", "json")).start(60)
    try:
        envoy = envoy_child([epp.port], tmp_path_factory.mktemp("envoy-split"),
                            split=True).start(60)
        try:
            yield envoy, epp
        finally:
            envoy.close()
    finally:
        epp.close()


def _count(client, url: str, name: str) -> float:
    """A labelled counter's value (0 before its first increment: the series is absent)."""
    match = re.search(rf"^{name} (\S+)$", client.get(url).text, re.M)
    return 0.0 if match is None else float(match.group(1))


def _access(epp, request_id: str) -> dict | None:
    """The EPP's access-log line for ``request_id`` (None: not logged yet)."""
    for line in epp.output().splitlines():
        if line.startswith("{") and request_id in line:
            record = json.loads(line)
            if record.get("logger") == "kvguard.access" and record.get("id") == request_id:
                return record
    return None


def _stream_open(envoy, body: dict, headers: bytes = b"") -> tuple[socket.socket, bytes]:
    """A raw streamed request through Envoy, read until its first SSE event arrived."""
    host, port = envoy.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\n" + headers + b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n"
                 + raw)
    received = b""
    while b"data: " not in received:
        received += sock.recv(65536)
    return sock, received


def test_the_split_config_passes_envoy_validate(tmp_path):
    rendered = envoy_config(tmp_path, listener_port=free_port(), admin_port=free_port(),
                            epp_ports=[free_port()], split=True)
    for path in (SPLIT_CONFIG, rendered):
        done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path),
                               "--disable-hot-restart"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    # several EPPs: a route and an observer cluster per EPP
    several = envoy_config(tmp_path, listener_port=free_port(), admin_port=free_port(),
                           epp_ports=[free_port(), free_port()], split=True)
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(several),
                           "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("path", list(BODIES))
def test_streams_reach_the_chosen_replica_and_the_observer_feeds_the_ticket(fleet, split,
                                                                            client, path):
    envoy, epp = split
    metrics = epp_metrics_url(epp)
    before = _count(client, metrics, COMPLETED)
    with client.stream("POST", envoy.url + path, json={**BODIES[path], "stream": True}) as stream:
        assert stream.status_code == 200
        # the EPP's pick (its header, from the decision's metadata) is where Envoy connected
        replica = stream.headers["x-kvguard-replica"]
        assert stream.headers["x-envoy-upstream-host"] == endpoints(fleet)[replica]
        assert float(stream.headers["x-kvguard-queue-ms"]) >= 0
        request_id = stream.headers["x-request-id"]
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 7
    # the observer stream reported the response: first token, usage, completed, released
    assert until(lambda: _access(epp, request_id) is not None), epp.output()[-3000:]
    record = _access(epp, request_id)
    assert (record["outcome"], record["status"], record["replica"]) == ("completed", 200,
                                                                       replica), epp.output()[-3000:]
    assert record["ttft_ms"] is not None and record["ttft_ms"] > 0
    assert record["output_tokens"] == 6  # the stream's usage chunk, seen by the observer
    assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
    assert _count(client, metrics, COMPLETED) == before + 1


def test_json_answers_and_unadmitted_requests_pass(split, client):
    envoy, epp = split
    answer = client.post(envoy.url + "/v1/completions", json=BODIES["/v1/completions"])
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
    assert until(lambda: _access(epp, answer.headers["x-request-id"]) is not None)
    record = _access(epp, answer.headers["x-request-id"])
    assert (record["outcome"], record["output_tokens"]) == ("completed", 6), record
    models = client.get(envoy.url + "/v1/models")  # no ticket: the observer has nothing to do
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert "x-kvguard-queue-ms" not in models.headers


def test_a_shed_is_envoys_local_reply_and_leaves_no_ticket(split, client):
    envoy, epp = split
    headers = {"authorization": "Bearer k-acme"}  # 2 requests per minute
    answers = [client.post(envoy.url + "/v1/completions", headers=headers,
                           json=BODIES["/v1/completions"]) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[2].headers["x-kvguard-reason"] == "rpm_limit"
    assert "x-kvguard-replica" not in answers[2].headers  # no decision metadata: no route
    assert until(lambda: metric(client, epp_metrics_url(epp), "kvguard_held_tickets") == 0)


def test_client_disconnect_mid_stream_releases_the_ticket_and_the_replicas_kv(fleet, split,
                                                                              client):
    envoy, epp = split
    metrics = epp_metrics_url(epp)
    canceled = _count(client, metrics, CANCELED)
    sock, received = _stream_open(envoy, LONG)
    with sock:
        assert metric(client, metrics, "kvguard_held_tickets") == 1
        replica = re.search(rb"x-kvguard-replica: (r\d)", received).group(1).decode()
    url = fleet.replica_urls[int(replica[1:])]

    def replica_idle() -> bool:
        state = client.get(url + "/kvguard/state").json()
        return not state["running"] and state["num_free_blocks"] == state["num_total_blocks"]
    # the client is gone: Envoy resets the upstream request (the replica frees the sequence),
    # and closes the observer stream after deferred_close_timeout (the ticket is released)
    assert until(replica_idle)
    assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
    assert _count(client, metrics, CANCELED) == canceled + 1


def test_a_forged_correlation_does_not_touch_another_requests_ticket(split, client):
    """An attacker who knows a victim's request id sends it in every header the split could
    plausibly read, then leaves mid-stream; the victim's ticket is unaffected."""
    envoy, epp = split
    metrics = epp_metrics_url(epp)
    canceled = _count(client, metrics, CANCELED)
    victim, received = _stream_open(envoy, LONG)
    with victim:
        victim_id = re.search(rb"x-request-id: (\S+)", received).group(1)
        forged = b"".join(name + b": " + victim_id + b"\r\n" for name in (
            b"x-request-id", b"x-kvguard-ticket", b"x-kvguard-token", b"kvguard"))
        attacker, _ = _stream_open(envoy, LONG, forged)
        assert metric(client, metrics, "kvguard_held_tickets") == 2
        attacker.close()  # the attacker leaves: only its own ticket is released
        assert until(lambda: _count(client, metrics, CANCELED) == canceled + 1)
        assert metric(client, metrics, "kvguard_held_tickets") == 1
        assert _access(epp, victim_id.decode()) is None  # the victim's is still held
    # the victim leaves too: its own ticket, released once
    assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
    assert _count(client, metrics, CANCELED) == canceled + 2


def test_a_ticket_no_observer_claims_is_released_after_the_wait(fleet, config, client,
                                                                tmp_path_factory):
    """The decision filter without its observer (Envoy's split config minus the observer
    filter): the request is served, and the EPP releases the ticket after
    ``--observer-wait-s`` instead of holding it forever."""
    epp = epp_child(fleet.replica_urls, config=config,
                    extra_args=("--observer-wait-s", "0.5")).start(60)
    try:
        directory = tmp_path_factory.mktemp("envoy-no-observer")
        listener_port = free_port()
        path = envoy_config(directory, listener_port=listener_port, admin_port=free_port(),
                            epp_ports=[epp.port], split=True)
        rendered = json.loads(path.read_text())
        manager = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][
            0]["typed_config"]
        manager["http_filters"] = [f for f in manager["http_filters"]
                                   if f["name"] != "kvguard.observer"]
        path.write_text(json.dumps(rendered))
        envoy = ChildProcess("envoy", lambda _port: [
            envoy_binary(), "-c", str(path), "--disable-hot-restart", "--log-level", "error",
            "--concurrency", "1"], http_health, port=listener_port).start(60)
        try:
            metrics = epp_metrics_url(epp)
            failed = _count(client, metrics, FAILED)
            answer = client.post(envoy.url + "/v1/completions", json=BODIES["/v1/completions"])
            assert answer.status_code == 200
            assert until(lambda: metric(client, metrics, "kvguard_held_tickets") == 0)
            assert _count(client, metrics, FAILED) == failed + 1  # no response was seen
            assert metric(client, metrics, "kvguard_epp_unobserved_total") == 1
            assert metric(client, metrics, "kvguard_epp_awaiting_observer") == 0
        finally:
            envoy.close()
    finally:
        epp.close()



def test_kvguard_fleet_observe_split_runs_envoy_on_the_split_config(config, client):
    with fleet_cli("--replicas", "1", "--proxies", "2", "--front", "envoy", "--observe",
                   "split", "--proxy-config", config) as (proc, lines):
        by_name = {fields[0]: fields for fields in lines}
        url, pid = by_name["envoy"][1], int(by_name["envoy"][3])
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        rendered = json.loads(open(argv[argv.index(b"-c") + 1]).read())
        manager = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][
            0]["typed_config"]
        observer = [f for f in manager["http_filters"] if f["name"] == "kvguard.observer"]
        assert observer and observer[0]["typed_config"]["observability_mode"] is True
        # two EPPs: each started with its --epp-id, a route back to each for its observers
        routes = manager["route_config"]["virtual_hosts"][0]["routes"]
        assert [r["match"].get("dynamic_metadata", [{}])[0].get("value") for r in routes] == [
            {"string_match": {"exact": epp_id(i)}} for i in range(2)] + [None]
        for index in range(2):
            argv = open(f"/proc/{by_name[f'epp-{index}'][3]}/cmdline", "rb").read().split(b"\0")
            assert argv[argv.index(b"--epp-id") + 1] == epp_id(index).encode()
        for _ in range(2):  # one decided by each EPP (round robin)
            with client.stream("POST", url + "/v1/completions",
                               json={**BODIES["/v1/completions"], "stream": True}) as stream:
                lines_out = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert stream.status_code == 200 and lines_out[-1] == "data: [DONE]"
            assert stream.headers["x-kvguard-replica"] == "r0"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


def test_kvguard_fleet_refuses_split_without_envoy():
    done = subprocess.run([sys.executable, "-m", "guard.cli", "fleet", "--observe", "split"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--observe split" in done.stderr


def test_with_two_epps_each_observer_stream_reaches_the_epp_that_decided(fleet, config, client,
                                                                          tmp_path_factory):
    """Envoy balances decision streams over both EPPs; each request's observer stream goes
    back to the EPP that decided it (a route per EPP on its ``kvguard``/``epp`` metadata)."""
    epps = [epp_child(fleet.replica_urls, config=config, name=f"epp-{i}",
                      extra_args=("--epp-id", epp_id(i))) for i in range(2)]
    try:
        for epp in epps:
            epp.start(60)
        envoy = envoy_child([e.port for e in epps], tmp_path_factory.mktemp("envoy-two"),
                            split=True).start(60)
        try:
            urls = [epp_metrics_url(e) for e in epps]
            for _ in range(8):
                with client.stream("POST", envoy.url + "/v1/completions",
                                   json={**BODIES["/v1/completions"], "stream": True}) as stream:
                    assert stream.status_code == 200
                    assert [line for line in stream.iter_lines()][-2] == "data: [DONE]"
            assert until(lambda: all(metric(client, u, "kvguard_held_tickets") == 0
                                     for u in urls))
            completed = [_count(client, u, COMPLETED) for u in urls]
            assert sum(completed) == 8 and all(n > 0 for n in completed), completed
            assert [metric(client, u, "kvguard_epp_unobserved_total") for u in urls] == [0, 0]
        finally:
            envoy.close()
    finally:
        for epp in epps:
            epp.close()
