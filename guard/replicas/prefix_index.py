"""``PrefixIndex``: which prefix blocks the guard believes each replica holds in its cache.

One least-recently-used set of chained block hashes per replica. A hash names a block *and
everything before it* (it is chained over its parent's hash), so a request's cached prefix on
a replica is the run of its leading hashes the replica holds. Two sources fill it
(:mod:`guard.replicas.prefix_cache`): the approximate view inserts a request's hashes on the
replica it was routed to; the precise view applies the replica's own KV-cache events
(:mod:`guard.replicas.kv_events`).

Memory is bounded: each replica holds at most its capacity in blocks (sized from the
replica's own block count, capped by ``max_blocks_per_replica``); inserting past it evicts the
least recently used. Measured: about 130 bytes per tracked block (an ``OrderedDict`` entry
and the 64-bit int it is keyed by; ``scripts/prefix_view_cost.py``, ``docs/benchmarks.md``), so
the default bound of 262,144 blocks per replica is at most ~33 MB per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Per-replica LRU sets of block hashes. Not thread-safe: one event loop."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        if isinstance(max_blocks_per_replica, bool) or not isinstance(
                max_blocks_per_replica, int) or max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica: must be an int >= 1, "
                             f"got {max_blocks_per_replica!r}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def capacity(self, replica_id: str) -> int:
        return self._capacity.get(replica_id, self.max_blocks_per_replica)

    def set_capacity(self, replica_id: str, num_blocks: int) -> None:
        """The replica's cache holds about ``num_blocks`` blocks (capped by the bound)."""
        capacity = max(1, min(num_blocks, self.max_blocks_per_replica))
        if self._capacity.get(replica_id) == capacity:
            return
        self._capacity[replica_id] = capacity
        self._evict(replica_id)

    def replica_ids(self) -> tuple[str, ...]:
        """The replicas the index holds blocks for."""
        return tuple(r for r, blocks in self._blocks.items() if blocks)

    def num_blocks(self, replica_id: str) -> int:
        blocks = self._blocks.get(replica_id)
        return len(blocks) if blocks is not None else 0

    def num_matched(self, replica_id: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a request's chain, first block first) lead the replica's
        cache: the length of the run it holds from the start."""
        blocks = self._blocks.get(replica_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica holds these blocks now (most recently used); evicts past capacity."""
        blocks = self._blocks.get(replica_id)
        if blocks is None:
            blocks = self._blocks[replica_id] = OrderedDict()
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self._evict(replica_id)

    def remove(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica evicted these blocks."""
        blocks = self._blocks.get(replica_id)
        if blocks:
            for h in hashes:
                blocks.pop(h, None)

    def clear(self, replica_id: str) -> None:
        """The replica's cache is empty (restarted, or it dropped every block)."""
        self._blocks.pop(replica_id, None)

    def _evict(self, replica_id: str) -> None:
        blocks = self._blocks.get(replica_id)
        if blocks is None:
            return
        excess = len(blocks) - self.capacity(replica_id)
        for _ in range(excess):
            blocks.popitem(last=False)
