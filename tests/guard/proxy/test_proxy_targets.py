"""The proxy forwards exactly the target it priced: on kvguard's server (the read-callback path)
and on uvicorn's h11 and httptools (the ASGI path), with the h1 client and aiohttp. A target
that reads as an admitted path in more than one way is a 400 that never reaches the replica;
no target is a 500. The proxy runs in-process on a real server, the replica is a scripted
upstream that records each request-target byte for byte, the client a raw socket."""

import contextlib
import json
import random
import socket

import pytest
from scripted_upstream import ScriptedUpstream, ok_json

from guard.config import GuardConfig
from guard.proxy.app import ProxyApp
from tests.support.loopback import serve_on

SERVERS = ("kvguard", "h11", "httptools")
CLIENTS = ("h1", "aiohttp")
BODY = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 4}).encode()
ANSWER = ok_json(b'{"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, '
                 b'"completion_tokens": 1, "total_tokens": 2}}')


@contextlib.contextmanager
def proxy_on(server: str, client: str, upstream_url: str):
    config = GuardConfig.from_dict({
        "policy": "always_admit",
        "replicas": [{"replica_id": "r0", "url": upstream_url, "state_source": "none",
                      "models": ["fake-model"]}],  # listed: only the test's requests go upstream
        "proxy": {"upstream_client": client, "read_timeout_s": 10.0}})
    app = ProxyApp(config)
    with serve_on(app, server, lifespan="on") as running:
        yield app, running.url


def exchange(url: str, target: bytes, body: bytes = BODY) -> tuple[int, bytes]:
    """One POST with this exact request-target over a fresh socket: (status, whole answer);
    status 0 when the server closed without an answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST " + target + b" HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                     % len(body) + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    if not received.startswith(b"HTTP/1.1 "):
        return 0, received
    return int(received[9:12]), received


@pytest.fixture(scope="module")
def upstream():
    with ScriptedUpstream(lambda target: ANSWER) as running:
        yield running


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("server", SERVERS)
def test_the_target_priced_is_the_target_forwarded(upstream, server, client):
    forwarded = [b"/v1/completions", b"/v1/%63ompletions?api-version=1&q=%2F%3F",
                 b"/openai/v1/completions?x=a/b?c", b"/v1/completions?q=%E2%82%AC"]
    refused = [b"/v1/completions%3F/v1/chat/completions", b"/v1/completions%3f/v1/chat/completions",
               b"/v1/completions%23/v1/chat/completions", b"/x%2Fv1/chat/completions",
               b"/v1%2Fcompletions", b"/v1/chat/completions/../../completions"]
    with proxy_on(server, client, upstream.url) as (app, url):
        del upstream.targets[:]
        for target in forwarded:
            status, answer = exchange(url, target)
            assert status == 200, answer
        assert upstream.targets == forwarded  # byte for byte, query included
        for target in refused:
            status, answer = exchange(url, target)
            assert status == 400, (target, answer)
            body = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert body["error"]["code"] == "invalid_request_target"
            assert b"x-should-retry: false" in answer.lower()
        assert upstream.targets == forwarded  # none of them reached the replica
        assert app.num_in_flight == 0


@pytest.mark.parametrize("server", SERVERS)
def test_a_non_ascii_target_is_a_400(upstream, server):
    with proxy_on(server, "h1", upstream.url) as (_, url):
        del upstream.targets[:]
        for target in ("/v1/chät/completions".encode(), b"/v1/chat/completions\xff",
                       "/v1/completions?q=€".encode()):
            status, answer = exchange(url, target)
            assert status == 400, (target, answer)
        assert upstream.targets == []


_ALPHABET = [b"/", b"v1", b"chat", b"completions", b"%2F", b"%3F", b"%23", b"%2e", b".", b"..",
             b"?", b"#", b"%", b"%zz", b"\xc3\xa4", b"\xff", b"\x7f", b"\t", b"\\", b"[", b"a",
             b"%00", b"*", b";", b"=", b"&", b"@", b":", b"%E2%82%AC", b"%20", b"%0d%0a"]


@pytest.mark.parametrize("server", SERVERS)
def test_no_target_is_a_500(upstream, server):
    rng = random.Random(31)
    targets = [b"/" + b"".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(1, 9)))
               for _ in range(60)]
    targets += [b"/v1/chat/completions" + t for t in targets[:20]]
    targets += [t + b"/v1/completions" for t in targets[:30]]  # admitted by their suffix
    with proxy_on(server, "h1", upstream.url) as (_, url):
        for target in targets:
            del upstream.targets[:]
            status, answer = exchange(url, target)
            assert status in (0, 200, 400, 404), (target, answer)
            if status == 200:  # what the replica ran is what was priced and sent
                assert upstream.targets == [target]
            else:
                assert upstream.targets == []
