"""The load generator's own work per request stays bounded with many connections open.

httpx (httpcore 1.0) rescanned every pooled connection — and, for each idle one, every
connection again — whenever a request entered or left its pool, so with ~1,000 connections
each request cost the generator tens of ms of CPU and a 2,000 req/s run stalled for minutes.
Here 800 requests are held open at once by a real loopback server (800 connections), then,
once those connections are idle, 800 more arrive together. The bound is on CPU time, not wall
time, and is ~10× what the generator needs on a loaded 2-core machine (~1 ms per request);
the quadratic pool needed far more.
"""

import asyncio
from collections import Counter

import pytest

from chaos.bench.loadgen import trivial_server
from chaos.load import LoadConfig, run_load
from chaos.records import RequestSpec

NUM_PER_WAVE = 800
MAX_CPU_S_PER_REQUEST = 0.015


def _wave(first_index: int, at_s: float) -> list[RequestSpec]:
    return [RequestSpec(index=first_index + i, scheduled_s=at_s, num_prompt_tokens=16,
                        max_tokens=4, request_class="interactive", tenant="t")
            for i in range(NUM_PER_WAVE)]


@pytest.mark.cpu_heavy
def test_many_pooled_connections_cost_the_generator_a_bounded_cpu_per_request():
    server = trivial_server("shed", hold_s=0.5).start()
    try:
        specs = _wave(0, 0.0) + _wave(NUM_PER_WAVE, 2.0)
        cfg = LoadConfig(url=server.url, duration_s=2.0, timeout_s=60.0, drain_timeout_s=120.0)
        result = asyncio.run(run_load(specs, cfg))
    finally:
        server.close()
    outcomes = Counter(r.outcome for r in result.records)
    assert outcomes == {"rejected": 2 * NUM_PER_WAVE}, Counter(r.error for r in result.records)
    per_request_s = result.cpu_s / len(specs)
    print(f"generator CPU {1e6 * per_request_s:.0f} µs per request, "
          f"waited {result.cpu_wait_s} s for a CPU")
    assert per_request_s < MAX_CPU_S_PER_REQUEST
