"""Slow clients for the server-limit tests: connections that trickle their request head or
body at 1 byte/s, sit idle after a request, or send nothing, and wait to be cut."""

from __future__ import annotations

import asyncio
import time

import httpx

__all__ = ["TRICKLE_FOR_S", "slow_client", "slowloris"]

TRICKLE_FOR_S = 60  # a trickler that is never cut sends for this long: the tests' hang guard


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


async def slow_client(host: str, port: int, kind: str) -> float | None:
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


async def slowloris(base_url: str, probe_path: str, probe_body: dict
                    ) -> tuple[list, httpx.Response, int]:
    """50 slow connections (15 trickle their head, 15 their body, 10 idle after a request, 10
    send nothing) and, once they are open, one normal POST: (seconds until each was cut, or
    None if never; the probe's response; how many were open when the probe was sent)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    kinds = ["head"] * 15 + ["body"] * 15 + ["idle"] * 10 + ["silent"] * 10
    clients = [asyncio.create_task(slow_client(host, int(port), k)) for k in kinds]
    await asyncio.sleep(0.2)  # let them connect
    num_open_at_probe = sum(not c.done() for c in clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, trust_env=False) as client:
        probe = await client.post(probe_path, json=probe_body)
    return await asyncio.gather(*clients), probe, num_open_at_probe
