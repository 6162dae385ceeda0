"""The proxy's upstream connections: pooled, kept alive, shared by requests and state polls.

A real ``kvguard proxy`` in front of a raw-HTTP upstream on loopback that lists which requests
each accepted connection carried; the proxy's state polls (``GET /kvguard/state`` every
``refresh_interval_s``) run throughout.
"""

import json
import re
import socket
import time

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


@pytest.mark.parametrize("upstream_client", ["aiohttp", "h1"])
def test_sequential_requests_reuse_a_kept_alive_connection_shared_with_state_polls(
        tmp_path, client, upstream_client):
    config = write_config(tmp_path, policy="always_admit", client=upstream_client)
    with running(upstream_child("ok")) as upstream, \
            running(proxy_child([upstream.url], config)) as proxy:
        for _ in range(NUM_STREAMS):
            _stream(client, proxy.url)
            # a poll interval and more with nothing in flight: a poll takes the connection a
            # request just gave back (without the pause every poll could fall while a request
            # held the other connection, and the polls never met a posting one)
            time.sleep(0.15)
        connections = client.get(upstream.url + "/connections").json()
    posting = [c for c in connections if any(r.startswith("POST") for r in c)]
    num_posts = sum(r.startswith("POST") for c in connections for r in c)
    assert num_posts == NUM_STREAMS
    # keep-alive: one request at a time never needs a connection per request (a poll in
    # flight when a request starts may add one more)
    assert len(posting) < NUM_STREAMS, json.dumps(connections)
    # the state polls ride the same pool (not a client of their own)
    assert any(r.startswith("GET /kvguard/state") for c in posting for r in c), \
            json.dumps(connections)


@pytest.mark.parametrize("upstream_client", ["h1", "aiohttp"])
def test_a_client_that_stops_reading_gets_the_whole_stream_in_order_after(
        tmp_path, upstream_client):
    """~16 MB streamed while the client reads nothing for a while (the proxy's writes to it
    pause, so does its reading from the upstream), then reads on: every event, in order."""
    config = write_config(tmp_path, policy="always_admit", client=upstream_client)
    with running(upstream_child("big")) as upstream, \
            running(proxy_child([upstream.url], config, state_source="none")) as proxy:
        host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
        body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 3, "stream": true}'
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            received = sock.recv(1 << 16)
            time.sleep(1.5)  # nothing read: the client's buffers fill, the proxy's writes pause
            while not received.endswith(b"\r\n0\r\n\r\n"):
                chunk = sock.recv(1 << 20)
                assert chunk, "the proxy closed the stream"
                received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    stream = _dechunk(received[received.index(b"\r\n\r\n") + 4:])
    numbers = [int(n) for n in re.findall(rb'"text": "(\d{8})x', stream)]
    assert numbers == list(range(4000))
    assert stream.endswith(b"data: [DONE]\n\n")


def _dechunk(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if not size:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        assert body[end + 2 + size:end + 4 + size] == b"\r\n"
        pos = end + 4 + size


def test_state_response_raises_for_an_error_status():
    StateResponse("http://x/kvguard/state", 200, b"{}").raise_for_status()
    assert StateResponse("http://x/metrics", 200, "é".encode()).text == "é"
    try:
        StateResponse("http://x/kvguard/state", 500, b"").raise_for_status()
    except UpstreamError as exc:
        assert "HTTP 500" in str(exc)
    else:
        raise AssertionError("a 500 answer must raise")
