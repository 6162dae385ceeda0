"""A serving process's start-up heap, kept out of Python's cyclic garbage collector.

A replica process builds a large, long-lived heap before it serves (an engine's tokenizer and
model tables). Every full collection walks all of it, and each collection is a pause of the
one event loop that every request and shed waits behind (the pauses measured under a flood
are in docs/benchmarks.md, section 1b).

:func:`settle_heap` runs once, after start-up and before the ready line: one full collection
(nothing that is already garbage is kept), then ``gc.freeze()`` moves everything alive into
the permanent generation, never walked again. The collection thresholds stay Python's: a
young collection walks about as many objects as its threshold, so raising it (as the load
generator does for its own CPU, ``chaos.load.few_collections``) makes each pause longer.
"""

from __future__ import annotations

import gc

__all__ = ["settle_heap"]


def settle_heap() -> None:
    """Collect once, then freeze what survives out of every later collection."""
    gc.collect()
    gc.freeze()
