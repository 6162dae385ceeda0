"""``kvguard proxy`` (a real process over loopback) bounds slow clients like the engine does:
50 connections trickling their head or body, idle after a request, or silent are all cut by
the configured timeouts while a normal request is relayed; over the per-client cap a
connection gets 503 and is closed. On kvguard's own HTTP server and on uvicorn."""

import asyncio

import pytest
from proxy_helpers import HTTP_SERVERS, proxy_child, running, upstream_child, write_config

from tests.support.slow_clients import TRICKLE_FOR_S, slowloris

pytestmark = pytest.mark.slow

LIMITS = ("--header-timeout-s", "2", "--body-timeout-s", "2", "--keep-alive-timeout-s", "2",
          "--max-connections-per-client", "55")  # 50 slow + the probe fit
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


async def _over_the_cap(url: str) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    held = [await asyncio.open_connection(host, int(port)) for _ in range(55)]
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await asyncio.wait_for(reader.read(), 30.0)  # the proxy closes after it
        writer.close()
        return answer
    finally:
        for _, w in held:
            w.close()


@pytest.mark.parametrize("http", HTTP_SERVERS)
def test_proxy_cuts_slow_clients_and_caps_connections(tmp_path, http):
    config = write_config(tmp_path)
    with running(upstream_child("ok")) as upstream, \
            running(proxy_child([upstream.url], config, state_source="none",
                                extra_args=LIMITS, http=http)) as proxy:
        closed_after_s, probe, _ = asyncio.run(slowloris(proxy.url, "/v1/completions", BODY))
        over_cap = asyncio.run(_over_the_cap(proxy.url))
    assert probe.status_code == 200, probe.text
    never_cut = [i for i, t in enumerate(closed_after_s) if t is None]
    assert not never_cut, f"connections still open after {TRICKLE_FOR_S} s: {never_cut}"
    assert over_cap.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in over_cap
