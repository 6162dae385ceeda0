"""Faults behind ``kvguard proxy``, real processes over loopback: a replica killed during 20
streams, a hung (SIGSTOP) replica, 500s and garbage, re-dispatch before the first byte."""

import asyncio
import json
import socket
import time

import httpx
import pytest
from proxy_helpers import HTTP_SERVER, proxy_child, running, upstream_child, write_config

from chaos.topology import Topology, TopologySpec

pytestmark = pytest.mark.slow
# the default upstream client and the one on raw asyncio protocols (same contract, same faults)
CLIENTS = pytest.mark.parametrize("upstream_client", ["aiohttp", "h1"])

MODEL = "llama-7b"  # what the fleet and the scripted upstreams serve
BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 4}


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    """Poll ``predicate`` until true; ``timeout_s`` is a hang guard, not a timing claim."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _replica_state(client, proxy_url: str, replica_id: str) -> dict:
    replicas = client.get(proxy_url + "/kvguard/state").json()["replicas"]
    return next(r for r in replicas if r["replica_id"] == replica_id)


def _metric(client, url: str, name: str) -> float:
    total = 0.0
    for line in client.get(url + "/kvguard/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _assert_names_the_replica_not_its_address(response, replica_id: str, url: str) -> None:
    """A failure answer tells the client which replica failed, never where it lives."""
    host_port = url.split("://", 1)[1].rstrip("/")
    assert f"replica {replica_id}" in response.json()["error"]["message"], response.text
    assert host_port not in response.text and host_port.split(":")[1] not in response.text


async def _stream(client: httpx.AsyncClient, url: str, started: asyncio.Queue) -> dict:
    body = {**BODY, "max_tokens": 400, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        replica = response.headers.get("x-kvguard-replica")
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                if not events:
                    await started.put(replica)
                events.append(line)
        return {"status": response.status_code, "replica": replica, "events": events,
                "ended_s": time.monotonic()}


@CLIENTS
def test_kill9_during_20_streams(tmp_path, client, upstream_client):
    config = write_config(tmp_path, client=upstream_client)
    spec = TopologySpec(num_replicas=2, num_proxies=1, proxy_args=("--config", config,
                                                                 "--http", HTTP_SERVER))
    with Topology(spec) as fleet:
        proxy_url = fleet.proxy_urls[0]

        async def main():
            started: asyncio.Queue = asyncio.Queue()
            async with httpx.AsyncClient(timeout=120.0, trust_env=False) as http:
                tasks = [asyncio.ensure_future(_stream(http, proxy_url, started))
                         for _ in range(20)]
                for _ in range(20):  # every stream has its first event
                    await asyncio.wait_for(started.get(), 120)
                killed_s = time.monotonic()
                fleet.replicas[0].kill()
                return killed_s, await asyncio.wait_for(asyncio.gather(*tasks), 120)

        killed_s, results = asyncio.run(main())
        on_dead = [r for r in results if r["replica"] == "r0"]
        on_survivor = [r for r in results if r["replica"] == "r1"]
        assert on_dead and on_survivor and len(on_dead) + len(on_survivor) == 20
        for result in on_survivor:
            assert result["events"][-1] == "data: [DONE]"
        for result in on_dead:
            last = json.loads(result["events"][-1][6:])
            assert last["error"]["code"] == "upstream_failed"
        worst_s = max(r["ended_s"] for r in on_dead) - killed_s
        print(f"streams on the killed replica ended {worst_s:.3f} s after SIGKILL")
        assert worst_s < 10.0  # hang guard; the measured number is in the report

        assert _wait_for(lambda: not _replica_state(client, proxy_url, "r0")["routable"])
        for _ in range(6):
            response = client.post(proxy_url + "/v1/completions", json=BODY)
            assert response.status_code == 200 and response.headers["x-kvguard-replica"] == "r1"

        fleet.replicas[0].restart()

        def r0_back() -> bool:
            state = _replica_state(client, proxy_url, "r0")
            return state["routable"] and state["state_age_s"] is not None \
                and state["state_age_s"] < 1.0

        assert _wait_for(r0_back)
        served = set()

        async def burst():
            async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:
                started: asyncio.Queue = asyncio.Queue()
                return await asyncio.gather(*(_stream(http, proxy_url, started)
                                              for _ in range(8)))

        # Routing is the policy's choice (lowest predicted TTFT), so one burst may all fit on r1;
        # the restarted replica must get traffic again within a few bursts.
        for _ in range(5):
            for result in asyncio.run(burst()):
                assert result["events"][-1] == "data: [DONE]"
                served.add(result["replica"])
            if "r0" in served:
                break
        assert "r0" in served, served


@CLIENTS
def test_hung_replica_gets_504_within_the_read_timeout_then_is_ejected(tmp_path, client,
                                                                        upstream_client):
    read_timeout_s = 1.0
    config = write_config(tmp_path, read_timeout_s=read_timeout_s, client=upstream_client)
    with Topology(TopologySpec(num_replicas=1)) as fleet, \
            running(proxy_child(fleet.replica_urls, config, state_source="none")) as proxy:
        assert client.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
        fleet.replicas[0].stop()
        for _ in range(2):  # eject_after_failures = 2
            sent_s = time.monotonic()
            response = client.post(proxy.url + "/v1/completions", json=BODY)
            waited_s = time.monotonic() - sent_s
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "upstream_timeout"
            _assert_names_the_replica_not_its_address(response, "r0", fleet.replica_urls[0])
            assert read_timeout_s * 0.9 <= waited_s < read_timeout_s + 10.0
        state = _replica_state(client, proxy.url, "r0")
        assert state["ejected"] and not state["routable"]
        shed = client.post(proxy.url + "/v1/completions", json=BODY)
        assert shed.status_code == 503  # nothing routable: shed, not sent to the hung replica
        assert client.get(proxy.url + "/health").status_code == 503

        fleet.replicas[0].cont()
        assert _wait_for(lambda: _replica_state(client, proxy.url, "r0")["routable"])
        assert client.post(proxy.url + "/v1/completions", json=BODY).status_code == 200


@CLIENTS
def test_failing_upstream_is_a_clear_502_then_ejected(tmp_path, client, upstream_client):
    # stays ejected while we look
    config = write_config(tmp_path, probe_interval_s=30.0, client=upstream_client)
    with running(upstream_child("status500", MODEL)) as bad, \
            running(proxy_child([bad.url], config, state_source="none")) as proxy:
        for _ in range(2):
            response = client.post(proxy.url + "/v1/completions", json=BODY)
            assert response.status_code == 502, response.text
            assert response.json()["error"]["code"] == "upstream_failed"
            assert response.headers["x-kvguard-reason"] == "upstream_failed"
            _assert_names_the_replica_not_its_address(response, "r0", bad.url)
        assert _replica_state(client, proxy.url, "r0")["ejected"]
        posts = client.get(bad.url + "/count").json()["posts"]
        assert client.post(proxy.url + "/v1/completions", json=BODY).status_code == 503
        assert client.get(bad.url + "/count").json()["posts"] == posts  # never sent again


@CLIENTS
def test_a_garbage_answer_is_a_502_never_resent_and_never_ejects(tmp_path, client,
                                                                 upstream_client):
    """The replica read the request and answered bytes that are not HTTP: the request is not
    sent again (to it or another replica: it may have run), and one malformed answer, however
    often, does not eject a replica (eject_after_failures = 2)."""
    config = write_config(tmp_path, probe_interval_s=30.0, client=upstream_client)
    with running(upstream_child("garbage", MODEL)) as bad, running(upstream_child("ok", MODEL)) as good, \
            running(proxy_child([bad.url, good.url], config, state_source="none")) as proxy:
        statuses = []
        for _ in range(6):
            response = client.post(proxy.url + "/v1/completions", json={**BODY, "stream": True})
            statuses.append((response.status_code, response.headers["x-kvguard-replica"]))
            if response.status_code == 502:
                assert response.json()["error"]["code"] == "upstream_failed"
        assert set(statuses) <= {(502, "r0"), (200, "r1")}
        num_bad = client.get(bad.url + "/count").json()["posts"]
        assert num_bad == statuses.count((502, "r0")) >= 1
        assert num_bad + client.get(good.url + "/count").json()["posts"] == 6
        assert not _replica_state(client, proxy.url, "r0")["ejected"]
        assert _metric(client, proxy.url, "kvguard_proxy_redispatches_total") == 0


@CLIENTS
def test_a_refused_connect_is_redispatched_and_the_dead_replica_ejected(tmp_path, client,
                                                                         upstream_client):
    config = write_config(tmp_path, probe_interval_s=30.0, client=upstream_client)
    with socket.socket() as dead, running(upstream_child("ok", MODEL)) as good:
        dead.bind(("127.0.0.1", 0))  # bound, never listening: every connect is refused
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        with running(proxy_child([dead_url, good.url], config, state_source="none",
                                 healthy=False)) as proxy:
            for _ in range(6):
                response = client.post(proxy.url + "/v1/completions",
                                       json={**BODY, "stream": True})
                assert response.status_code == 200 and response.headers["x-kvguard-replica"] == "r1"
                assert response.text.rstrip().endswith("data: [DONE]")
            assert _replica_state(client, proxy.url, "r0")["ejected"]
            assert _metric(client, proxy.url, "kvguard_proxy_redispatches_total") >= 1
            assert client.get(good.url + "/count").json()["posts"] == 6


@CLIENTS
def test_a_replicas_503_moves_the_request_on_and_never_ejects_it(tmp_path, client,
                                                                 upstream_client):
    config = write_config(tmp_path, probe_interval_s=30.0, client=upstream_client)
    with running(upstream_child("status503", MODEL)) as busy, running(upstream_child("ok", MODEL)) as good, \
            running(proxy_child([busy.url], config, state_source="none")) as alone, \
            running(proxy_child([busy.url, good.url], config, state_source="none")) as pair:
        for _ in range(4):  # eject_after_failures = 2: a 503 is not a failure
            relayed = client.post(alone.url + "/v1/completions", json=BODY)
            assert relayed.status_code == 503 and relayed.headers["retry-after"] == "7"
            assert relayed.headers["x-kvguard-replica"] == "r0"
            moved = client.post(pair.url + "/v1/completions", json=BODY)
            assert moved.status_code == 200 and moved.headers["x-kvguard-replica"] == "r1"
        assert not _replica_state(client, alone.url, "r0")["ejected"]
        assert not _replica_state(client, pair.url, "r0")["ejected"]


def _chunked_post(port: int, body: bytes) -> bytes:
    """One chunked POST written whole in one send (the proxy's server holds all of it when
    the head is parsed); the raw answer."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part)
                      for part in (body[:40], body[40:]) if part)
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30.0) as sock:
        sock.sendall(request)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


def test_a_whole_chunked_body_is_held_to_the_byte_limit_and_relayed_under_it(tmp_path, client):
    config = write_config(tmp_path)
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write("max_body_bytes = 300\n" + text)
    small = json.dumps(BODY).encode()
    large = json.dumps({**BODY, "prompt": "x" * 400}).encode()
    with running(upstream_child("ok", MODEL)) as upstream, \
            running(proxy_child([upstream.url], config, state_source="none")) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        refused = _chunked_post(port, large)
        assert refused.startswith(b"HTTP/1.1 413 "), refused[:200]
        assert client.get(upstream.url + "/count").json()["posts"] == 0
        relayed = _chunked_post(port, small)
        assert relayed.startswith(b"HTTP/1.1 200 "), relayed[:200]
        assert client.get(upstream.url + "/count").json()["posts"] == 1


def test_bad_input_never_reaches_an_upstream(tmp_path, client):
    config = write_config(tmp_path)
    with running(upstream_child("ok", MODEL)) as upstream, \
            running(proxy_child([upstream.url], config, state_source="none")) as proxy:
        for body in (b'{"prompt": "hi", ', b"[1]", b'{"prompt": "hi", "stream": "yes"}',
                     b'{"messages": [{"role": "wizard", "content": "x"}]}',
                     b'{"prompt": "' + b"x" * (2 << 20) + b'"}'):
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            response = client.post(proxy.url + path, content=body,
                                   headers={"content-type": "application/json"})
            assert response.status_code in (400, 413), response.text
            assert response.headers["x-should-retry"] == "false"
        assert client.get(upstream.url + "/count").json()["posts"] == 0
        assert client.post(proxy.url + "/v1/completions", json=BODY).status_code == 200
        assert client.get(upstream.url + "/count").json()["posts"] == 1
