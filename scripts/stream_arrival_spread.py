"""Where in each interval a guard's state stream events arrive (docs/benchmarks.md §17, "The
guard asks each stream for its own phase").

A state-only fleet of N replicas whose streams send in step (``stream_phase="aligned"``, time
scale 50) and the guard's sources for them (``guard.replicas.poller.state_sources``, kind
``stream``, 100 ms), all opened at once as the poller does; after the first second, for 3 s,
each event's arrival is noted. Printed: per interval, the most events inside any 5 ms and any
10 ms window (median and max over the intervals). Run it from each checkout to compare:

    PYTHONPATH=$PWD .venv/bin/python scripts/stream_arrival_spread.py 256 LABEL
"""

from __future__ import annotations

import asyncio
import statistics
import sys

from chaos.state_fleet import StateFleet, StateFleetConfig
from guard.config import ReplicaConfig
from guard.replicas.poller import state_sources

INTERVAL_S, WARMUP_S, SECONDS = 0.1, 1.0, 3.0


def _busiest(offsets: list[float], window_s: float) -> int:
    return max(sum(1 for y in offsets if x <= y < x + window_s) for x in offsets)


async def main(num_replicas: int, label: str) -> None:
    fleet = StateFleet(StateFleetConfig(stream_phase="aligned", time_scale=50.0,
                                        num_kv_blocks=250))
    await fleet.start(num_replicas)
    replicas = tuple(ReplicaConfig(replica_id=rid, url=url, state_source="stream")
                     for rid, url in fleet.urls.items())
    sources = list(state_sources(replicas, None, stream_interval_s=INTERVAL_S).values())
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []
    for source in sources:
        source.listen(lambda _payload: arrivals.append(loop.time()))
    start_s = loop.time() + WARMUP_S
    await asyncio.gather(*(source.opened(5.0) for source in sources))
    await asyncio.sleep(WARMUP_S + SECONDS - (loop.time() - (start_s - WARMUP_S)))
    for source in sources:
        await source.aclose()
    await fleet.stop()
    per_interval: dict[int, list[float]] = {}
    for t in arrivals:
        if t >= start_s:
            k = int((t - start_s) / INTERVAL_S)
            per_interval.setdefault(k, []).append((t - start_s) % INTERVAL_S)
    whole = [offsets for _, offsets in sorted(per_interval.items())[:-1]]  # the last is cut
    b5 = [_busiest(offsets, 0.005) for offsets in whole]
    b10 = [_busiest(offsets, 0.010) for offsets in whole]
    print(f"{label} N={num_replicas} intervals={len(whole)} "
          f"events/interval={statistics.median(len(o) for o in whole):g} "
          f"busiest 5 ms: median {statistics.median(b5):g} max {max(b5)}; "
          f"busiest 10 ms: median {statistics.median(b10):g} max {max(b10)}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""))
