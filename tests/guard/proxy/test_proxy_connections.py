"""The proxy's upstream connections: pooled, kept alive, shared by requests and state polls.

A real ``kvguard proxy`` in front of a raw-HTTP upstream on loopback that lists which requests
each accepted connection carried; the proxy's state polls (``GET /kvguard/state`` every
``refresh_interval_s``) run throughout.
"""

import json

import pytest

from guard.proxy.state_client import StateResponse
from guard.proxy.transports import UpstreamError
from tests.guard.proxy.proxy_helpers import proxy_child, running, upstream_child, write_config

NUM_STREAMS = 8


def _stream(client, url: str) -> None:
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3, "stream": True}
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert b"[DONE]" in b"".join(response.iter_raw())


@pytest.mark.parametrize("upstream_client", ["aiohttp", "httpx", "h1"])
def test_sequential_requests_reuse_a_kept_alive_connection_shared_with_state_polls(
        tmp_path, client, upstream_client):
    config = write_config(tmp_path, policy="always_admit", client=upstream_client)
    with running(upstream_child("ok")) as upstream, \
            running(proxy_child([upstream.url], config)) as proxy:
        for _ in range(NUM_STREAMS):
            _stream(client, proxy.url)
        connections = client.get(upstream.url + "/connections").json()
    posting = [c for c in connections if any(r.startswith("POST") for r in c)]
    num_posts = sum(r.startswith("POST") for c in connections for r in c)
    assert num_posts == NUM_STREAMS
    # keep-alive: one request at a time never needs a connection per request (a poll in
    # flight when a request starts may add one more)
    assert len(posting) < NUM_STREAMS, json.dumps(connections)
    # the state polls ride the same pool (not a client of their own)
    assert any("GET /kvguard/state" in c for c in posting), json.dumps(connections)


def test_state_response_raises_for_an_error_status():
    StateResponse("http://x/kvguard/state", 200, b"{}").raise_for_status()
    assert StateResponse("http://x/metrics", 200, "é".encode()).text == "é"
    try:
        StateResponse("http://x/kvguard/state", 500, b"").raise_for_status()
    except UpstreamError as exc:
        assert "HTTP 500" in str(exc)
    else:
        raise AssertionError("a 500 answer must raise")
