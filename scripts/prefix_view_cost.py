"""What the guard's prefix-cache view costs: bytes per tracked block, and the time to key and
match one request (``python scripts/prefix_view_cost.py``; numbers for docs/benchmarks.md).

Memory: ``tracemalloc`` around filling one replica's index with N distinct 64-bit hashes (the
approximate view's keys are Python ints of that size, the precise view's the engine's
uint64s), divided by N. Time: ``timeit`` of ``PrefixCacheView.key`` and ``cached_tokens`` for a
chat request of a 2,000-token system prompt (~8,000 characters) against 4 replicas.
"""

from __future__ import annotations

import random
import timeit
import tracemalloc

from guard.replicas.prefix_cache import PrefixCacheView
from guard.replicas.prefix_index import PrefixIndex


def bytes_per_block(num_blocks: int) -> float:
    """Bytes the index holds per block: its table entry and the hash's int object (the
    request that made the hash is gone; the index alone keeps it)."""
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(num_blocks)
    hashes = [rng.getrandbits(64) | (1 << 63) for _ in range(num_blocks)]
    index.insert("r0", hashes)
    del hashes
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert index.num_blocks("r0") == num_blocks
    return (after - before) / num_blocks


def request_cost_us(num_runs: int = 2000) -> tuple[float, float]:
    view = PrefixCacheView()
    body = {"model": "m", "messages": [{"role": "system", "content": "y" * 8000},
                                       {"role": "user", "content": "q" * 400}]}
    key = view.key(body, True, 2100, 4.0, None)
    for i, replica in enumerate("abcd"):
        view.index.insert(replica, key.hashes[:8 * (i + 1)])
    key_s = timeit.timeit(lambda: view.key(body, True, 2100, 4.0, None), number=num_runs)
    match_s = timeit.timeit(lambda: view.cached_tokens(key), number=num_runs)
    return key_s / num_runs * 1e6, match_s / num_runs * 1e6


def main() -> None:
    for n in (10_000, 1_000_000):
        print(f"index of {n:,} blocks: {bytes_per_block(n):.1f} bytes per tracked block")
    key_us, match_us = request_cost_us()
    print(f"key a 2,000-token chat prompt: {key_us:.1f} us; match it on 4 replicas: "
          f"{match_us:.1f} us")


if __name__ == "__main__":
    main()
