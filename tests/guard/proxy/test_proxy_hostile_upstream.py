"""A replica that answers badly, through the whole proxy (in-process, on kvguard's server and on
uvicorn h11, with the h1 client and aiohttp), in front of a scripted upstream:

* a 150 KB SSE stream written in one burst leaves its pooled connection fit for the next
  client's request (it used to go back to the pool with reading paused: a 504);
* a response head with a bare LF, a NUL, a non-token name or 10,000 fields is a 502 whose
  header never reaches the client, and does not eject the replica (aiohttp, the fallback
  client, reads a bare LF as a line end, as RFC 9112 §2.2 allows: its two fields are valid
  and relayed; the h1 client refuses it);
* a POST the replica read and then closed on is answered 502 and never sent again."""

import contextlib
import json

import httpx
import pytest
from scripted_upstream import ScriptedUpstream, ok_json, sse_burst

from guard.config import GuardConfig
from guard.proxy.app import ProxyApp
from tests.support.loopback import serve_on

BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}
ANSWER = ok_json(b'{"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, '
                 b'"completion_tokens": 1, "total_tokens": 2}}')
_HOSTILE_HEADS = {
    b"/lf/v1/completions": b"x-evil: a\nx-smuggled: b\r\n",
    b"/nul/v1/completions": b"x-evil: a\x00b\r\n",
    b"/name/v1/completions": b"x evil: a\r\n",
    b"/ctl/v1/completions": b"x-evil: a\x01b\r\n",
    b"/many/v1/completions": b"".join(b"x-evil-%d: a\r\n" % i for i in range(10_000)),
}
_BURST = sse_burst(150_000)


def answer(target: bytes) -> bytes | None:
    if target in _HOSTILE_HEADS:
        return ok_json(b"{}", _HOSTILE_HEADS[target])
    if target == b"/burst/v1/completions":
        return _BURST
    if target == b"/close/v1/completions":
        return None  # read, then closed without a byte of answer
    return ANSWER


@contextlib.contextmanager
def proxy_on(server: str, client: str, upstream_url: str):
    config = GuardConfig.from_dict({
        "policy": "always_admit",
        "replicas": [{"replica_id": "r0", "url": upstream_url, "state_source": "none",
                      "models": ["fake-model"]}],  # listed: only the test's requests go upstream
        "proxy": {"upstream_client": client, "read_timeout_s": 10.0,
                  "eject_after_failures": 2, "probe_interval_s": 30.0}})
    app = ProxyApp(config)
    with serve_on(app, server, lifespan="on") as running:
        yield app, running.url


PROXIES = pytest.mark.parametrize("server, client", [
    ("kvguard", "h1"), ("h11", "h1"), ("kvguard", "aiohttp"), ("h11", "aiohttp")])


@pytest.fixture(scope="module")
def upstream():
    with ScriptedUpstream(answer) as running:
        yield running


@PROXIES
def test_a_burst_stream_leaves_a_connection_the_next_client_can_use(upstream, server, client):
    with proxy_on(server, client, upstream.url) as (app, url):
        for _ in range(6):
            with httpx.Client(timeout=20.0, trust_env=False) as first:
                stream = first.post(url + "/burst/v1/completions", json={**BODY, "stream": True})
                assert stream.status_code == 200
                assert len(stream.content) > 150_000
                assert stream.text.rstrip().endswith("data: [DONE]")
            with httpx.Client(timeout=20.0, trust_env=False) as second:  # another client
                response = second.post(url + "/v1/completions", json=BODY)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == "ok"
        assert not app.health.is_ejected("r0")


@PROXIES
def test_a_hostile_response_head_is_a_502_never_relayed_and_never_ejects(upstream, server,
                                                                          client):
    with proxy_on(server, client, upstream.url) as (app, url), \
            httpx.Client(timeout=20.0, trust_env=False) as http:
        for _ in range(2):  # eject_after_failures = 2: each kind twice, and more in all
            for target in _HOSTILE_HEADS:
                response = http.post(url + target.decode(), json=BODY)
                if client == "aiohttp" and target == b"/lf/v1/completions":
                    assert response.headers["x-evil"] == "a"  # two valid fields
                    assert response.headers["x-smuggled"] == "b"
                    continue
                assert response.status_code == 502, (target, response.text)
                assert response.json()["error"]["code"] == "upstream_failed"
                assert not any(name.startswith("x-evil") or name.startswith("x-smuggled")
                               or name.startswith("x evil") for name in response.headers)
        assert not app.health.is_ejected("r0")
        assert app.health.consecutive_failures("r0") == 0
        num_refused = 2 * (len(_HOSTILE_HEADS) - (client == "aiohttp"))
        assert app.controller.registry.get_sample_value(
            "kvguard_proxy_upstream_failures_total",
            {"replica": "r0", "kind": "malformed"}) == num_refused  # counted apart
        assert http.post(url + "/v1/completions", json=BODY).status_code == 200


@PROXIES
def test_a_post_the_replica_read_and_closed_on_is_never_sent_again(upstream, server, client):
    with proxy_on(server, client, upstream.url) as (_, url), \
            httpx.Client(timeout=20.0, trust_env=False) as http:
        for pooled in (False, True):
            if pooled:  # a kept-alive connection to the replica, for the next to reuse
                assert http.post(url + "/v1/completions", json=BODY).status_code == 200
            del upstream.targets[:]
            response = http.post(url + "/close/v1/completions", json=BODY)
            assert response.status_code == 502, response.text
            assert json.loads(response.text)["error"]["code"] == "upstream_failed"
            assert upstream.targets == [b"/close/v1/completions"]  # received exactly once
