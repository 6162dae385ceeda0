"""The proxy's drain deadline, real processes over loopback: SIGTERM, a stream that outlives
``drain_timeout_s`` is cut once, at that deadline, with an SSE error event (not a bare TCP
abort), a request whose replica has not answered yet gets a 503 ``shutting_down``, and the
proxy exits 0."""

import concurrent.futures
import json
import signal
import time

import pytest
from proxy_helpers import HTTP_SERVERS, proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow

DRAIN_TIMEOUT_S = 3.0
BODY = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 2000,
        "stream": True}


def _drain_config(tmp_path, read_timeout_s: float = 2.0):
    path = write_config(tmp_path, read_timeout_s=read_timeout_s)
    config = tmp_path / "drain.toml"
    config.write_text(open(path).read().replace("drain_timeout_s = 20.0",
                                                f"drain_timeout_s = {DRAIN_TIMEOUT_S}"))
    return str(config)


@pytest.mark.parametrize("http", HTTP_SERVERS)
def test_a_stream_past_the_drain_deadline_ends_with_an_error_event(tmp_path, client, http):
    config = _drain_config(tmp_path)
    with running(upstream_child("slow")) as upstream, \
            running(proxy_child([upstream.url], config, state_source="none",
                                http=http)) as proxy:
        with client.stream("POST", proxy.url + "/v1/completions", json=BODY) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            signalled_s = time.monotonic()
            proxy.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]  # raises on an abort
            ended_s = time.monotonic()
        assert rest, "the stream ended without a last event"
        last = json.loads(rest[-1][len("data: "):])
        assert last["error"]["code"] == "shutting_down", rest[-3:]
        assert "data: [DONE]" not in rest
        # one deadline: cut at drain_timeout_s, not after it twice (a wide margin for a busy box)
        assert DRAIN_TIMEOUT_S * 0.9 <= ended_s - signalled_s < 2 * DRAIN_TIMEOUT_S
        assert proxy.proc.wait(30) == 0



def test_a_request_not_answered_by_the_deadline_gets_a_503(tmp_path, client):
    config = _drain_config(tmp_path, read_timeout_s=60.0)  # no 504 before the deadline
    with running(upstream_child("hang")) as upstream, \
            running(proxy_child([upstream.url], config, state_source="none")) as proxy:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.post, proxy.url + "/v1/completions",
                                  json={**BODY, "stream": False})
            deadline_s = time.monotonic() + 30  # a hang guard: the request reaches the replica
            while client.get(upstream.url + "/count").json()["posts"] < 1:
                assert time.monotonic() < deadline_s
                time.sleep(0.05)
            proxy.proc.send_signal(signal.SIGTERM)
            response = pending.result(timeout=30)
        assert response.status_code == 503, response.text
        assert response.headers["x-kvguard-reason"] == "shutting_down"
        assert proxy.proc.wait(30) == 0
