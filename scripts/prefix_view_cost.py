"""What the guard's prefix-cache view costs: bytes per tracked block, and the time to key and
match one request (``python scripts/prefix_view_cost.py``; numbers for docs/benchmarks.md).

Memory: ``tracemalloc`` around filling one replica's index with N distinct 64-bit hashes (the
approximate view's keys are Python ints of that size, the precise view's the engine's
uint64s), divided by N. Time: ``timeit`` of ``PrefixCacheView.key`` and ``cached_tokens`` for a
chat request of a 2,000-token system prompt (~8,000 characters) against 4 replicas.

The precise view in front of vLLM (:mod:`guard.replicas.kv_event_translation`): bytes per
translated block (the index's entry plus the vLLM-hash -> kvguard-hash map's, with vLLM's
32-byte hashes and with its 64-bit int ones), and the time to translate one stored block.
"""

from __future__ import annotations

import random
import timeit
import tracemalloc

from guard.replicas.block_hashes import root_hash
from guard.replicas.kv_event_translation import BlockTranslator
from guard.replicas.kv_events import BlockStored
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


def _stored_events(rng: random.Random, num_blocks: int, hash_bytes: int | None,
                   blocks_per_event: int = 16) -> list[BlockStored]:
    """Chained stored events as decoded from vLLM (32-byte hashes read as ints, or 64-bit)."""
    events, parent = [], None
    for _ in range(num_blocks // blocks_per_event):
        hashes = tuple(int.from_bytes(rng.randbytes(hash_bytes), "big") if hash_bytes
                       else rng.getrandbits(64) for _ in range(blocks_per_event))
        tokens = [rng.randrange(50_000) for _ in range(16 * blocks_per_event)]
        events.append(BlockStored(hashes, parent, tokens, 16))
        parent = hashes[-1]
    return events


def translated_bytes_per_block(num_blocks: int, hash_bytes: int | None) -> float:
    """Bytes per translated block: the index's entry and kvguard int, the map's entry and
    the vLLM hash it is keyed by (the events themselves are gone once applied)."""
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(num_blocks)
    translator = BlockTranslator(index, lambda _r: root_hash("m"))
    events = _stored_events(rng, num_blocks, hash_bytes)
    for event in events:
        translator.stored("r0", event)
    del events, event
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert index.num_blocks("r0") == num_blocks == translator.num_mapped("r0")
    return (after - before) / num_blocks


def translate_cost_us(num_blocks: int = 16_384) -> tuple[float, float]:
    """Microseconds per stored block: translated (hash its tokens, map, insert) vs a kvguard
    engine's event inserted as it is."""
    events = _stored_events(random.Random(1), num_blocks, 32)
    index = PrefixIndex(num_blocks)
    translator = BlockTranslator(index, lambda _r: root_hash("m"))
    translate_s = timeit.timeit(lambda: [translator.stored("r0", e) for e in events], number=1)
    native = PrefixIndex(num_blocks)
    native_s = timeit.timeit(lambda: [native.insert("r0", e.block_hashes) for e in events],
                             number=1)
    return translate_s / num_blocks * 1e6, native_s / num_blocks * 1e6


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
    for n in (10_000, 1_000_000):
        for hash_bytes, what in ((32, "32-byte"), (None, "64-bit int")):
            print(f"translated (vLLM {what} hashes), {n:,} blocks: "
                  f"{translated_bytes_per_block(n, hash_bytes):.1f} bytes per tracked block")
    translate_us, native_us = translate_cost_us()
    print(f"a stored block: translated {translate_us:.2f} us, applied as it is "
          f"{native_us:.2f} us")
    key_us, match_us = request_cost_us()
    print(f"key a 2,000-token chat prompt: {key_us:.1f} us; match it on 4 replicas: "
          f"{match_us:.1f} us")


if __name__ == "__main__":
    main()
