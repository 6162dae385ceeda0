"""Two ``kvguard epp`` behind one real Envoy, sharing Redis, and the EPP that decided a running
stream SIGKILLed: with ``deploy/envoy/envoy.yaml`` (the response streams through the EPP) and
with ``deploy/envoy/envoy-split.yaml`` (a decision filter and an observer filter in
observability mode). Real sim replicas, Redis, Envoy and EPPs on loopback."""

import json
import re
import signal
import socket
import time
import urllib.request

import pytest
import redis
from epp_helpers import MODEL, REPLICA_ARGS, metric, until, write_config

from chaos.envoy_front import envoy_child, envoy_config, epp_child, epp_metrics_url, front_stats
from chaos.ports import free_port
from chaos.topology import Topology, TopologySpec

pytestmark = pytest.mark.slow

CONFIG = """
policy = "slo"
refresh_interval_s = 0.1
state_timeout_s = 0.5
allow_anonymous = true
"""
# at the sim's time scale 5 a decode step takes ~35 ms: 120 tokens run for ~4 s
LONG = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 120, "stream": True}
SHORT = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4}
LEASE_S = 2.0  # a shared KV reservation's lease at refresh_interval_s 0.1 (guard.epp.server)


def _open_stream(url: str) -> tuple[socket.socket, bytes]:
    """A raw HTTP/1.1 streamed request through Envoy, read until its first SSE event."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(LONG).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\ncontent-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    received = b""
    while b"data: " not in received:
        received += sock.recv(65536)
    return sock, received


def _read_to_the_end(sock: socket.socket, received: bytes) -> bytes:
    """Everything until the chunked body's last chunk, or until Envoy closes the connection."""
    while not received.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def _epp_hosts(admin_url: str) -> str:
    """Envoy's admin ``/clusters`` lines of the EPP cluster that the decision filter uses."""
    with urllib.request.urlopen(admin_url + "/clusters", timeout=5.0) as response:
        text = response.read().decode()
    return "\n".join(line for line in text.splitlines() if line.startswith("kvguard_epp::"))


def _failed_active_hc(admin_url: str, port: int) -> bool:
    """Envoy's active health checks have marked the EPP on ``port`` failed."""
    flags = f"kvguard_epp::127.0.0.1:{port}::health_flags::"
    return any(line.startswith(flags) and "failed_active_hc" in line
               for line in _epp_hosts(admin_url).splitlines())


def _shared_entries(client: redis.Redis) -> int:
    """KV reservations published to Redis by any guard, over every replica."""
    return sum(client.hlen(key) for key in client.scan_iter("kvguard:*:entries"))


@pytest.mark.parametrize("split", [False, True], ids=["one filter", "split"])
def test_killing_the_epp_that_decided_a_running_stream(client, tmp_path_factory, split):
    """What must hold when the EPP that decided a stream dies while it runs:

    * the stream: with the split config it **flows on to its end** (``[DONE]`` and the chunked
      body's last chunk): its decision stream had ended, and its observer is in observability
      mode with ``failure_mode_allow``, so Envoy never waits on the dead EPP; only the ticket's
      view of the response is lost with it. With one filter the response passes through the
      EPP, so Envoy cuts the stream (no ``[DONE]``, no last chunk);
    * the surviving EPP decides every new request but the one Envoy sends the dead EPP before
      ejecting it (a 500, or none when the cut stream's reset ejected it), **and still after
      that ejection ended**: Envoy's health checks keep the dead EPP out
      (``no_traffic_interval``; without it the next check is a minute away);
    * the survivor holds no ticket and waits for no observer afterwards (the dead EPP's
      observer stream went to the dead EPP's route, never to it);
    * no KV reservation stays in Redis past its lease."""
    config = write_config(tmp_path_factory, CONFIG, "kill.toml")
    spec = TopologySpec(num_replicas=2, replica_args=REPLICA_ARGS, num_epps=2, redis=True,
                        split=split, proxy_args=("--config", config))
    with Topology(spec) as fleet:
        metrics = [epp_metrics_url(e) for e in fleet.epps]
        url = fleet.envoy.url
        sock, received = _open_stream(url)
        with sock:
            held = [metric(client, m, "kvguard_held_tickets") for m in metrics]
            assert sorted(held) == [0, 1], held
            dead = held.index(1)
            fleet.epps[dead].kill()
            received = _read_to_the_end(sock, received)
        ended = received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert ended is split, received[-300:]

        survivor = metrics[1 - dead]
        first = [client.post(url + "/v1/completions", json=SHORT).status_code for _ in range(8)]
        assert first.count(500) <= 1 and first.count(200) == 8 - first.count(500), first
        # What keeps the dead EPP out once its outlier ejection ends (at Envoy's first 10 s
        # ejection sweep past base_ejection_time): Envoy's active health checks, which keep
        # running and mark it failed. Without no_traffic_interval the next check after the
        # first is a minute away and the flag never comes within the wait. Waiting for the
        # flag instead of the ejection's end keeps 16 s of sleep out of the suite.
        dead_port = fleet.epps[dead].port
        assert until(lambda: _failed_active_hc(fleet.envoy_admin_url, dead_port),
                     timeout_s=10.0), _epp_hosts(fleet.envoy_admin_url)
        later = [client.post(url + "/v1/completions", json=SHORT).status_code for _ in range(8)]
        assert later == [200] * 8, later
        stats = front_stats(fleet.envoy_admin_url, tmp_path_factory.mktemp("stats") / "s.txt")
        assert stats["health_check.network_failure"] > 0, stats

        assert until(lambda: metric(client, survivor, "kvguard_held_tickets") == 0)
        if split:
            assert metric(client, survivor, "kvguard_epp_awaiting_observer") == 0
            assert metric(client, survivor, "kvguard_epp_unobserved_total") == 0
        completed = re.search(r'^kvguard_requests_completed_total\{[^}]*\} (\S+)$',
                              client.get(survivor).text, re.M)
        assert completed is not None and float(completed.group(1)) >= 16 - 1

        store = redis.Redis.from_url(fleet.redis_url)
        try:
            assert until(lambda: _shared_entries(store) == 0, timeout_s=LEASE_S + 5.0)
        finally:
            store.close()


STALL_S = 1.5  # an EPP kept off the CPU this long misses one or two health checks (0.5 s each)


def test_a_stalled_survivor_keeps_the_dead_epp_out(fleet, config, client, tmp_path_factory):
    """With one EPP dead, the survivor misses its health checks for a while (stopped: as a
    process kept off the CPU on a loaded machine). Had that marked it unhealthy, Envoy would
    have had no healthy EPP and sent streams to both in panic mode, the dead one's each a 500.
    Timeouts and refused connects count toward ``unhealthy_threshold`` (3): the survivor stays
    in, the dead EPP stays out (an EPP that answers NOT_SERVING, draining, is out at once)."""
    epps = [epp_child(fleet.replica_urls, config=config, name=f"epp-{i}").start(60)
            for i in range(2)]
    try:
        admin_port = free_port()
        envoy = envoy_child([e.port for e in epps], tmp_path_factory.mktemp("envoy-stall"),
                            admin_port=admin_port).start(60)
        try:
            epps[0].kill()
            first = [client.post(envoy.url + "/v1/completions", json=SHORT).status_code
                     for _ in range(4)]
            assert first.count(500) <= 1, first  # the stream that ejected it
            epps[1].proc.send_signal(signal.SIGSTOP)
            time.sleep(STALL_S)
            epps[1].proc.send_signal(signal.SIGCONT)
            after = [client.post(envoy.url + "/v1/completions", json=SHORT).status_code
                     for _ in range(8)]
            assert after == [200] * 8, after
            stats = front_stats(f"http://127.0.0.1:{admin_port}",
                                tmp_path_factory.mktemp("stats") / "s.txt")
            assert stats["lb_healthy_panic"] == 0, stats
        finally:
            envoy.close()
    finally:
        for epp in epps:
            epp.close()


@pytest.mark.parametrize("split", [False, True], ids=["one filter", "split"])
def test_a_stream_cut_at_a_replica_kill_is_closed_to_the_client_without_delay(tmp_path, split):
    """When a replica dies mid-body Envoy resets the client's stream (no filter can write an
    error event first); both shipped configs then close the connection at once
    (``delayed_close_timeout: 0s``) instead of waiting Envoy's default second for the client
    to close it. The delay itself is measured in docs/benchmarks.md §15; here, that the
    setting is in the file Envoy runs."""
    path = envoy_config(tmp_path, listener_port=free_port(), admin_port=free_port(),
                        epp_ports=[free_port()], split=split)
    rendered = json.loads(path.read_text())
    manager = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert manager["delayed_close_timeout"] == "0s"
