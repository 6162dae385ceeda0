"""2 sim replicas + ``kvguard proxy``, real processes over loopback: pass-through, model union,
routing spread, client disconnect, a vLLM-style upstream, SIGTERM drain."""

import asyncio
import contextlib
import json
import signal
import time
import uuid

import httpx
import pytest
from proxy_helpers import (
    HTTP_SERVER,
    HTTP_SERVERS,
    proxy_child,
    running,
    sse_lines,
    upstream_child,
    write_config,
)

from chaos.topology import Topology, TopologySpec

pytestmark = pytest.mark.slow

MODEL = "llama-7b"
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 6},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 6,
                             "messages": [{"role": "user", "content": "hello there"}]},
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("proxy"))
    spec = TopologySpec(num_replicas=2, num_proxies=1, proxy_args=("--config", config,
                                                                 "--http", HTTP_SERVER))
    with Topology(spec) as topology:
        yield topology


@pytest.fixture(scope="module")
def proxy_urls(fleet, tmp_path_factory):
    """The fleet's proxy (the default upstream client, h1) and one on the aiohttp client, same
    replicas and server."""
    config = write_config(tmp_path_factory.mktemp("proxy-aiohttp"), client="aiohttp")
    with running(proxy_child(fleet.replica_urls, config)) as other:
        yield {"h1": fleet.proxy_urls[0], "aiohttp": other.url}


CLIENTS = pytest.mark.parametrize("upstream_client", ["aiohttp", "h1"])


@CLIENTS
@pytest.mark.parametrize("path", list(BODIES))
def test_json_and_stream_pass_through(proxy_urls, client, path, upstream_client):
    url = proxy_urls[upstream_client] + path
    response = client.post(url, json=BODIES[path])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6
    assert response.headers["x-kvguard-replica"] in ("r0", "r1")
    assert uuid.UUID(response.headers["x-request-id"]).version == 4

    with client.stream("POST", url, json={**BODIES[path], "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse_lines(stream)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("error" not in c for c in chunks) and len(chunks) >= 6


@CLIENTS
def test_the_trace_has_when_each_content_chunk_was_forwarded(fleet, client, tmp_path,
                                                             upstream_client):
    """``chunks_s``: one time per content chunk, in order, within the response: on the h1
    client's push path (chunks written from the upstream's read callback) and on the relay
    task's path alike. Without them ``kvguard timeline`` cannot split a slow gap at the proxy."""
    trace = tmp_path / "trace.jsonl"
    config = tmp_path / "traced.toml"
    config.write_text(f'trace_path = "{trace}"\n'
                      + open(write_config(tmp_path, client=upstream_client)).read())
    body = {**BODIES["/v1/completions"], "max_tokens": 8, "stream": True}
    with running(proxy_child(fleet.replica_urls, str(config))) as proxy:
        with client.stream("POST", proxy.url + "/v1/completions", json=body) as stream:
            request_id = stream.headers["x-request-id"]
            events = sse_lines(stream)
        assert events[-1] == "data: [DONE]"
        texts = [e for e in events[:-1] if json.loads(e[6:])["choices"]]
        line = None
        for _ in range(200):  # the trace line is written as the ticket is released
            lines = [json.loads(x) for x in trace.read_text().splitlines()] \
                if trace.exists() else []
            line = next((x for x in lines if x["request_id"] == request_id), None)
            if line is not None:
                break
            time.sleep(0.05)
    assert line is not None and line["num_content_chunks"] >= 1
    chunks = line["chunks_s"]
    assert len(chunks) == line["num_content_chunks"] <= len(texts)
    assert chunks == sorted(chunks)
    assert line["first_token_s"] <= chunks[0] and chunks[-1] <= line["completion_s"]


def test_models_are_the_union_of_the_replicas(fleet, client, tmp_path):
    config = write_config(tmp_path)
    with running(upstream_child("ok", "other-model")) as other, \
            running(proxy_child([fleet.replica_urls[0], other.url], config,
                                state_source="none")) as proxy:
        ids = sorted(m["id"] for m in client.get(proxy.url + "/v1/models").json()["data"])
    assert ids == sorted([MODEL, "other-model"])
    assert [m["id"] for m in client.get(fleet.proxy_urls[0] + "/v1/models").json()["data"]] \
        == [MODEL]


def test_routing_spreads_concurrent_streams_over_both_replicas(fleet):
    async def one(client):
        body = {**BODIES["/v1/completions"], "max_tokens": 48, "stream": True}
        async with client.stream("POST", fleet.proxy_urls[0] + "/v1/completions",
                                 json=body) as response:
            text = (await response.aread()).decode()
            return response.status_code, response.headers.get("x-kvguard-replica"), text

    async def main():
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    results = asyncio.run(main())
    assert all(status == 200 and text.rstrip().endswith("data: [DONE]")
               for status, _, text in results)
    assert {replica for _, replica, _ in results} == {"r0", "r1"}


WEIGHTED = """
policy = "slo"
refresh_interval_s = 0.1
[policy_params]
stale_max_inflight_per_replica = 32   # the stale rule's bound (64) stays above this test's 40
[[replicas]]
url = "{0}"
state_source = "none"
weight = 3
[[replicas]]
url = "{1}"
state_source = "none"
weight = 1
"""


def test_weights_split_concurrent_streams_on_replicas_without_state(fleet, client, tmp_path):
    """With no load state (``state_source = "none"``) routing is requests ÷ weight: 40 streams
    held open at once land 30 : 10 on weights 3 : 1 (each admission is counted before the next
    decision, so the split does not depend on timing; the streams outlast the test)."""
    config = tmp_path / "weighted.toml"
    config.write_text(WEIGHTED.format(*fleet.replica_urls))
    body = {**BODIES["/v1/completions"], "max_tokens": 3000, "stream": True}

    async def main(proxy_url):
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http, \
                contextlib.AsyncExitStack() as streams:
            responses = await asyncio.gather(*(streams.enter_async_context(
                http.stream("POST", proxy_url + "/v1/completions", json=body))
                for _ in range(40)))
            state = (await http.get(proxy_url + "/kvguard/state")).json()
            return [r.status_code for r in responses], \
                [r.headers.get("x-kvguard-replica") for r in responses], state

    with running(proxy_child([], str(config))) as proxy:
        statuses, served, state = asyncio.run(main(proxy.url))
    assert statuses == [200] * 40
    assert state["num_in_flight"] == 40  # all held open at once
    replicas = {r["replica_id"]: r for r in state["replicas"]}
    assert {rid: r["weight"] for rid, r in replicas.items()} == {"r0": 3.0, "r1": 1.0}
    assert (served.count("r0"), served.count("r1")) == (30, 10)
    assert (replicas["r0"]["num_inflight"], replicas["r1"]["num_inflight"]) == (30, 10)


@pytest.mark.parametrize("http", HTTP_SERVERS)
def test_client_disconnect_frees_the_upstream_blocks(fleet, client, tmp_path, http):
    body = {**BODIES["/v1/completions"], "max_tokens": 3000, "stream": True}
    with running(proxy_child(fleet.replica_urls, write_config(tmp_path), http=http)) as proxy:
        _disconnect_frees_the_blocks(fleet, client, proxy.url, body)


def test_client_disconnect_frees_the_upstream_blocks_over_the_aiohttp_client(fleet, proxy_urls,
                                                                              client):
    body = {**BODIES["/v1/completions"], "max_tokens": 3000, "stream": True}
    _disconnect_frees_the_blocks(fleet, client, proxy_urls["aiohttp"], body)


def _disconnect_frees_the_blocks(fleet, client, proxy_url: str, body: dict) -> None:
    with client.stream("POST", proxy_url + "/v1/completions", json=body) as stream:
        replica = int(stream.headers["x-kvguard-replica"][1:])
        # hold the line iterator: a discarded one is closed at once, and closing it closes the
        # connection (the client would leave before the replica's state is read)
        lines = stream.iter_lines()
        first = next(lines)  # the stream is running on the replica
        state = client.get(fleet.replica_urls[replica] + "/kvguard/state").json()
        assert state["running"] and state["num_free_blocks"] < state["num_total_blocks"], \
            (first, state)
        left_s = time.monotonic()
    freed_s = None
    while time.monotonic() - left_s < 30:  # hang guard; the bound asserted is below
        state = client.get(fleet.replica_urls[replica] + "/kvguard/state").json()
        if not state["running"] and state["num_free_blocks"] == state["num_total_blocks"]:
            freed_s = time.monotonic() - left_s
            break
        time.sleep(0.02)
    print(f"blocks freed {freed_s} s after the client left")
    assert freed_s is not None and freed_s < 10.0
    proxy_state = client.get(proxy_url + "/kvguard/state").json()
    assert proxy_state["num_in_flight"] == 0


def test_bad_input_is_answered_by_the_proxy(fleet, client):
    before = [client.get(u + "/kvguard/state").json()["step_count"] for u in fleet.replica_urls]
    bad = [b'{"prompt": "hi", ', b"[1, 2]", b'{"prompt": "hi", "max_tokens": "ten"}',
           b'{"model": "llama-7b", "max_tokens": 4}', b'{"model": "nope", "prompt": "hi"}',
           b'{"prompt": [1, 2, 3], "max_tokens": 100000}']
    for body in bad:
        response = client.post(fleet.proxy_urls[0] + "/v1/completions", content=body,
                               headers={"content-type": "application/json"})
        assert response.status_code in (400, 404), response.text  # 404: model not served
        assert response.headers["x-should-retry"] == "false"
        assert "x-kvguard-replica" not in response.headers
    after = [client.get(u + "/kvguard/state").json()["step_count"] for u in fleet.replica_urls]
    assert after == before


def test_vllm_style_upstream_is_routed_and_protected(fleet, client, tmp_path):
    config = write_config(tmp_path)
    with running(proxy_child([fleet.replica_urls[0]], config, state_source="vllm")) as proxy:
        replica = client.get(proxy.url + "/kvguard/state").json()["replicas"][0]
        assert replica["state_source"] == "vllm" and replica["routable"]
        assert replica["capacity_known"] and replica["num_total_blocks"] > 0
        with client.stream("POST", proxy.url + "/v1/chat/completions",
                           json={**BODIES["/v1/chat/completions"], "stream": True}) as stream:
            assert stream.status_code == 200 and sse_lines(stream)[-1] == "data: [DONE]"
        bad = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "n": "two",
                                                               "max_tokens": 0})
        assert bad.status_code == 400


@pytest.mark.parametrize("http", HTTP_SERVERS)
def test_sigterm_drains_then_exits_zero(fleet, client, tmp_path, http):
    config = write_config(tmp_path)
    with running(proxy_child(fleet.replica_urls, config, http=http)) as proxy:
        body = {**BODIES["/v1/completions"], "max_tokens": 200, "stream": True}
        with client.stream("POST", proxy.url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(lines)
            proxy.proc.send_signal(signal.SIGTERM)
            deadline_s = time.monotonic() + 30
            while time.monotonic() < deadline_s:  # new requests are refused while draining
                refused = client.post(proxy.url + "/v1/completions", json=BODIES["/v1/completions"])
                if refused.status_code == 503:
                    break
                time.sleep(0.05)
            assert refused.status_code == 503
            assert refused.headers["x-kvguard-reason"] == "shutting_down"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert proxy.proc.wait(30) == 0
