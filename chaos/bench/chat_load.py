"""Seeded open-loop chat streams against one URL, judged at the client.

A small runner for the engine-facing benches and tests (the full load generator,
:mod:`chaos.load`, speaks token-id completions; servers like llama-cpp-python's take chat):
Poisson arrivals from a seed — the same schedule for every target — each a streamed
``/v1/chat/completions``. A request is good when it answered 200, ended with a
``finish_reason`` (an interrupted stream has none), its first content arrived within
``ttft_s`` of sending and no gap between contents exceeded ``itl_s``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

__all__ = ["ChatOutcome", "ChatLoad", "one_stream", "open_loop", "arrival_gaps_s"]


@dataclass(frozen=True)
class ChatLoad:
    """What to send: ``num_requests`` Poisson arrivals at ``rate_rps`` from ``seed``."""

    rate_rps: float
    num_requests: int
    max_tokens: int
    seed: int = 0
    model: str = "model"
    prompt: str = "Write one sentence about the sea."
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.rate_rps > 0 or self.num_requests < 1 or self.max_tokens < 1:
            raise ValueError("ChatLoad: rate_rps must be > 0, num_requests and max_tokens >= 1")


@dataclass(frozen=True)
class ChatOutcome:
    status: int | None  # None: no answer (connection error, timeout)
    ttft_s: float | None
    max_gap_s: float
    finished: bool  # a finish_reason arrived
    num_chunks: int

    def good(self, ttft_s: float, itl_s: float) -> bool:
        return (self.status == 200 and self.finished and self.ttft_s is not None
                and self.ttft_s <= ttft_s and self.max_gap_s <= itl_s)


def arrival_gaps_s(load: ChatLoad) -> list[float]:
    rng = random.Random(load.seed)
    return [rng.expovariate(load.rate_rps) for _ in range(load.num_requests)]


async def one_stream(client: httpx.AsyncClient, url: str, load: ChatLoad) -> ChatOutcome:
    body = {"model": load.model, "max_tokens": load.max_tokens, "stream": True,
            "messages": [{"role": "user", "content": load.prompt}]}
    start_s = time.monotonic()
    first_s = last_s = None
    max_gap_s, finished, num_chunks = 0.0, False, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now_s = time.monotonic()
                if '"content":' in line and '"content":""' not in line \
                        and '"content": ""' not in line and '"content":null' not in line \
                        and '"content": null' not in line:
                    num_chunks += 1
                    if first_s is None:
                        first_s = now_s
                    else:
                        max_gap_s = max(max_gap_s, now_s - last_s)
                    last_s = now_s
                finished = finished or '"finish_reason":"' in line \
                    or '"finish_reason": "' in line
            status = response.status_code
    except httpx.HTTPError:
        return ChatOutcome(None, None, 0.0, False, num_chunks)
    return ChatOutcome(status, None if first_s is None else first_s - start_s, max_gap_s,
                       finished, num_chunks)


async def open_loop(url: str, load: ChatLoad,
                    on_arrival: Callable[[int], None] | None = None) -> list[ChatOutcome]:
    """Send every arrival at its time, whatever the answers; wait for all of them."""
    async with httpx.AsyncClient(timeout=load.timeout_s, trust_env=False,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        tasks = []
        for i, gap_s in enumerate(arrival_gaps_s(load)):
            await asyncio.sleep(gap_s)
            tasks.append(asyncio.create_task(one_stream(client, url, load)))
            if on_arrival is not None:
                on_arrival(i + 1)
        return list(await asyncio.gather(*tasks))
