"""The proxy's drain deadline, real processes over loopback: SIGTERM, a stream that outlives
``drain_timeout_s`` is cut once, at that deadline, with an SSE error event (not a bare TCP
abort), and the proxy exits 0."""

import json
import signal
import time

import pytest
from proxy_helpers import HTTP_SERVERS, proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow

DRAIN_TIMEOUT_S = 3.0
BODY = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 2000,
        "stream": True}


@pytest.mark.parametrize("http", HTTP_SERVERS)
def test_a_stream_past_the_drain_deadline_ends_with_an_error_event(tmp_path, client, http):
    path = write_config(tmp_path)
    config = tmp_path / "drain.toml"
    config.write_text(open(path).read().replace("drain_timeout_s = 20.0",
                                                f"drain_timeout_s = {DRAIN_TIMEOUT_S}"))
    with running(upstream_child("slow")) as upstream, \
            running(proxy_child([upstream.url], str(config), state_source="none",
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

