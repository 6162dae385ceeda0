"""Paged KV cache bookkeeping: a pool of reference-counted blocks and per-request block tables.

Only ids and counts live here; the K/V tensors belong to the runner. Blocks are handed out
from the front of a FIFO free list and returned to its back, so block ids are deterministic.
"""

from __future__ import annotations

import collections
import math

__all__ = ["BlockManager", "BlockPool"]


class BlockPool:
    """``num_blocks`` blocks, each with a reference count; free blocks have count 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, num: int) -> list[int] | None:
        """``num`` fresh blocks with count 1, or None (and nothing taken) if too few are free."""
        if num > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free and cannot be shared")
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} released more often than taken")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block} has negative count {count}"
            assert (count == 0) == (block in free), f"block {block}: count {count} vs free list"


class BlockManager:
    """Per-request block tables over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens in total.

        Returns the newly added blocks (possibly none), or None when the pool cannot supply
        them — then nothing changes and the caller decides whom to preempt.
        """
        table = self._tables.get(request_id, [])
        num_needed = self.num_blocks_for(num_tokens) - len(table)
        if num_needed <= 0:
            return []
        new_blocks = self.pool.take(num_needed)
        if new_blocks is None:
            return None
        self._tables[request_id] = table + new_blocks
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let ``child_id`` share every block of ``parent_id`` (reference counted)."""
        if child_id in self._tables:
            raise ValueError(f"{child_id} already holds blocks")
        table = list(self._tables.get(parent_id, []))
        for block in table:
            self.pool.share(block)
        self._tables[child_id] = table

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many it held."""
        table = self._tables.pop(request_id, [])
        for block in table:
            self.pool.release(block)
        return len(table)

    def holders(self) -> list[str]:
        return list(self._tables)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        counts = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.pool.ref_counts, "block tables disagree with reference counts"
