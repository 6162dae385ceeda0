"""A serving process's start-up heap, kept out of Python's cyclic garbage collector.

A replica process builds a large, long-lived heap before it serves (an engine's tokenizer and
model tables: ~54 k tracked objects still alive for the sim's 7 B tokenizer). Every full
collection walks all of it: 46 ms for that heap alone (best of 5, on a loaded machine), and
104–175 ms per full collection in ``kvguard engine --http kvguard`` under ``kvguard bench
sheds`` (2,000 req/s; that heap, the flood's own objects and CPU wait), each a pause of the
one event loop every shed waits behind (docs/benchmarks.md, section 1b).

:func:`settle_heap` runs once, after start-up and before the ready line: one full collection
(nothing that is already garbage is kept), then ``gc.freeze()`` moves everything alive into
the permanent generation, never walked again. The collection thresholds stay Python's: a
young collection walks about as many objects as its threshold, so raising it (as the load
generator does for its own CPU, ``chaos.load.few_collections``) makes each pause longer —
young collections of 22–62 ms were measured with a threshold of 20,000 in the same flood.
"""

from __future__ import annotations

import gc

__all__ = ["settle_heap"]


def settle_heap() -> None:
    """Collect once, then freeze what survives out of every later collection."""
    gc.collect()
    gc.freeze()
