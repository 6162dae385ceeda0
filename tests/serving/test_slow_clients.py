"""Slow and greedy clients against a real ``kvguard engine --model tiny`` over loopback: 50
connections that trickle their head or body at 1 byte/s, sit idle after a request, or send
nothing are all cut by the configured timeouts while a normal request is served."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S = 2.0, 2.0, 2.0
TRICKLE_FOR_S = 60  # a trickler that is never cut sends for this long: the test's hang guard


@pytest.fixture(scope="module")
def engine():
    args = ["--model", "tiny", "--device", "cpu", "--num-blocks", "64",
            "--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
            "--keep-alive-timeout-s", str(KEEP_ALIVE_TIMEOUT_S)]
    with start_engine(args) as eng:
        yield eng


def _closed_counts(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10.0, trust_env=False).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "kvguard_engine_connections_closed_total"}


async def _until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        trickle: bytes) -> float | None:
    """Send ``trickle`` one byte a second (nothing when empty) until the server closes the
    connection; the seconds that took, or None if it never did."""
    start_s = time.monotonic()
    for i in range(TRICKLE_FOR_S):
        try:
            if trickle:
                writer.write(trickle[i % len(trickle):i % len(trickle) + 1])
                await writer.drain()
            if await asyncio.wait_for(reader.read(65536), timeout=1.0) == b"":
                return time.monotonic() - start_s
        except asyncio.TimeoutError:
            continue
        except (ConnectionError, OSError):
            return time.monotonic() - start_s
    return None


async def _slow_client(host: str, port: int, kind: str) -> float | None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if kind == "head":
            return await _until_closed(reader, writer, b"POST /v1/completions HTTP/1.1\r\nHo")
        if kind == "body":
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
            return await _until_closed(reader, writer, b"x")
        if kind == "idle":
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await writer.drain()
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)).startswith(
                b"HTTP/1.1 200")
        return await _until_closed(reader, writer, b"")  # idle after a request, or silent
    finally:
        writer.close()


async def _slowloris(base_url: str) -> tuple[list, httpx.Response, int]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    kinds = ["head"] * 15 + ["body"] * 15 + ["idle"] * 10 + ["silent"] * 10
    clients = [asyncio.create_task(_slow_client(host, int(port), k)) for k in kinds]
    await asyncio.sleep(0.2)  # let them connect
    num_open_at_probe = sum(not c.done() for c in clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, trust_env=False) as client:
        probe = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                           "ignore_eos": True})
    return await asyncio.gather(*clients), probe, num_open_at_probe


def test_slow_connections_are_cut_while_a_probe_is_served(engine):
    before = _closed_counts(engine.base_url)
    closed_after_s, probe, num_open_at_probe = asyncio.run(_slowloris(engine.base_url))
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
