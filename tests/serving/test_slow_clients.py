"""Slow and greedy clients against a real ``kvguard engine --model tiny`` over loopback: 50
connections that trickle their head or body at 1 byte/s, sit idle after a request, or send
nothing are all cut by the configured timeouts while a normal request is served. On uvicorn
(h11) and on kvguard's own HTTP server (``--http kvguard``)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

from tests.support.slow_clients import TRICKLE_FOR_S, slowloris  # noqa: E402

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S = 2.0, 2.0, 2.0


@pytest.fixture(scope="module", params=["h11", "kvguard"])
def engine(request):
    args = ["--model", "tiny", "--device", "cpu", "--num-blocks", "64", "--http", request.param,
            "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
            "--keep-alive-timeout-s", str(KEEP_ALIVE_TIMEOUT_S)]
    with start_engine(args) as eng:
        yield eng


def _closed_counts(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10.0, trust_env=False).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "kvguard_engine_connections_closed_total"}


def test_slow_connections_are_cut_while_a_probe_is_served(engine):
    before = _closed_counts(engine.base_url)
    probe_body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
    closed_after_s, probe, num_open_at_probe = asyncio.run(
        slowloris(engine.base_url, "/v1/completions", probe_body))
    assert probe.status_code == 200, probe.text
    assert probe.json()["usage"]["completion_tokens"] == 3
    never_cut = [i for i, t in enumerate(closed_after_s) if t is None]
    assert not never_cut, f"connections still open after {TRICKLE_FOR_S} s: {never_cut}"
    after = _closed_counts(engine.base_url)
    assert after["header_timeout"] - before["header_timeout"] >= 25  # head tricklers + silent
    assert after["body_timeout"] - before["body_timeout"] >= 15
    print(f"\n{num_open_at_probe} of 50 slow connections open when the probe was sent; "
          f"cut after {min(closed_after_s):.1f}..{max(closed_after_s):.1f} s")
    assert httpx.get(engine.base_url + "/health", trust_env=False).status_code == 200
    assert "Traceback" not in engine.output()


def test_garbage_requests_are_counted_not_logged_one_by_one(engine):
    """Any client can send malformed requests: 30 of them leave at most one summary line."""
    host, port = engine.base_url.removeprefix("http://").rsplit(":", 1)

    async def garbage() -> list[bytes]:
        answers = []
        for _ in range(30):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GARBAGE / NOT-HTTP\r\n\r\n")
            answers.append(await asyncio.wait_for(reader.read(), 30.0))
            writer.close()
        return answers

    answers = asyncio.run(garbage())
    assert all(a.startswith(b"HTTP/1.1 400") for a in answers), answers[:2]
    assert httpx.get(engine.base_url + "/health", trust_env=False).status_code == 200
    output = engine.output()
    assert "Invalid HTTP request received." not in output
    assert output.count("invalid HTTP request(s) in the last") <= 1
